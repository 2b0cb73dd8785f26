"""Seeded random init in which every value is a function of (seed, parameter name, element index).

A rank fills its own shard of a parameter (FSDP, TP or EP, any world size) without generating the
rest, and the gathered model is the same whatever the plan: the init of a model built on the meta
device, sharded there, then materialised rank by rank. The generator is counter-based (a SplitMix64
finalizer over the element's global flat index, keyed by the parameter), written in integer tensor
ops, so it runs on the parameter's own device. Which distribution a parameter gets is read from the
model: a torchtitan module's ``param_init`` (normal with a std, ones, zeros), else the default its
module type would draw (``nn.Linear``'s uniform(+-1/sqrt(fan_in)), an embedding's standard normal,
a norm's ones and zeros).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torchtitan.protocols.module import Module

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # SplitMix64's constants as signed int64 (torch multiplies with wraparound)
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
CHUNK_ELEMENTS = 1 << 18  # values generated at a time
# The host high-water mark of filling one chunk (measured on CPU: its int64 / float64 temporaries and
# what the allocator keeps of them), which the dry run's memory plan adds to a start-up without a checkpoint.
INIT_WORKSPACE_BYTES = 48 * 2**20


@dataclass(frozen=True)
class InitRule:
    """``normal`` (std = scale), ``uniform`` on [-scale, scale], or ``constant`` (= scale)."""

    kind: Literal["normal", "uniform", "constant"]
    scale: float


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers activation checkpointing and compile insert."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _rule_of_callable(init, module: nn.Module, name: str) -> InitRule:
    partial = isinstance(init, functools.partial)
    func, args, kwargs = (init.func, init.args, init.keywords) if partial else (init, (), {})
    if func is nn.init.normal_ and not args and kwargs.get("mean", 0.0) == 0.0:
        return InitRule("normal", float(kwargs.get("std", 1.0)))
    if func is nn.init.ones_:
        return InitRule("constant", 1.0)
    if func is nn.init.zeros_:
        return InitRule("constant", 0.0)
    raise ValueError(f"{type(module).__name__}.{name}: no counter-based form of its initializer {init!r}")


def _default_rule(module: nn.Module, name: str) -> InitRule:
    """What the module type's own ``reset_parameters`` draws."""
    if isinstance(module, nn.Linear):
        return InitRule("uniform", 1.0 / math.sqrt(module.in_features))  # kaiming_uniform(a=sqrt(5)), and the bias
    if isinstance(module, nn.Embedding):
        return InitRule("normal", 1.0)
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        return InitRule("constant", 1.0 if name == "weight" else 0.0)
    raise ValueError(f"{type(module).__name__}.{name}: no param_init and no known default initializer")


def init_rules(model: nn.Module) -> dict[str, tuple[InitRule, nn.Parameter]]:
    """Canonical parameter name -> (its rule, the parameter). A tied parameter appears once, under the
    name and rule of the last module that owns it (the one whose init wins in ``init_states``)."""
    by_param: dict[int, tuple[str, InitRule, nn.Parameter]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            inits = getattr(module, "_param_init", None)
            rule = _rule_of_callable(inits[name], module, name) if inits else _default_rule(module, name)
            full = canonical_name(f"{module_name}.{name}" if module_name else name)
            by_param[id(param)] = (full, rule, param)
    return {full: (rule, param) for full, rule, param in by_param.values()}


def local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global offset, local shape)`` of this rank's part of ``param`` (the whole tensor when it is
    not a DTensor). Every plan osvl applies (FSDP2 / TP / EP, nested) leaves one contiguous box."""
    if not isinstance(param, DTensor):
        return (0,) * param.dim(), tuple(param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(offset), tuple(shape)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def parameter_key(seed: int, name: str) -> int:
    """The stream of one parameter: a stable 64-bit hash of the seed and its canonical name."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def counter_values(rule: InitRule, key: int, index: torch.Tensor) -> torch.Tensor:
    """float64 values of ``rule`` at the int64 global flat indices ``index`` of the stream ``key``."""
    if rule.kind == "constant":
        return torch.full(index.shape, rule.scale, dtype=torch.float64, device=index.device)
    bits = _mix(index * _GOLDEN + key)
    high = (_shift_right(bits, 32).double() + 0.5) * 2.0**-32  # two 32-bit uniforms in (0, 1) per hash
    if rule.kind == "uniform":
        return (2.0 * high - 1.0) * rule.scale
    low = ((bits & 0xFFFFFFFF).double() + 0.5) * 2.0**-32
    return torch.sqrt(-2.0 * torch.log(high)) * torch.cos(2.0 * math.pi * low) * rule.scale  # Box-Muller


def _row_chunks(offset: tuple[int, ...], shape: tuple[int, ...], global_shape: tuple[int, ...]) -> Iterator:
    """``(local row range, global flat indices)`` of the box, a few million values at a time."""
    if not shape:
        yield slice(None), torch.zeros((), dtype=torch.int64)
        return
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(shape))]
    inner = torch.zeros((), dtype=torch.int64)
    for d in range(len(shape) - 1, 0, -1):
        axis = (torch.arange(shape[d], dtype=torch.int64) + offset[d]) * strides[d]
        inner = axis.view(-1, *([1] * inner.dim())) + inner
    per_row = max(1, math.prod(shape[1:]))
    rows = max(1, CHUNK_ELEMENTS // per_row)
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        lead = (torch.arange(start, stop, dtype=torch.int64) + offset[0]) * strides[0]
        yield slice(start, stop), lead.view(-1, *([1] * inner.dim())) + inner


@torch.no_grad()
def fill_local(param: torch.Tensor, rule: InitRule, key: int) -> None:
    """Writes ``rule``'s values into this rank's part of ``param`` (in place), chunk by chunk."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    offset, shape = local_box(param)
    if tuple(local.shape) != shape:
        raise ValueError(f"local shard {tuple(local.shape)} is not the planned box {shape}")
    for rows, index in _row_chunks(offset, shape, tuple(param.shape)):
        local[rows].copy_(counter_values(rule, key, index.to(local.device)))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Seeded init of every parameter's local part, then the modules' own buffers (MoE counters)."""
    for name, (rule, param) in init_rules(model).items():
        fill_local(param, rule, parameter_key(seed, name))
    init_buffers(model)


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """The torchtitan modules' own buffers, on the device they were materialised on."""
    for module in model.modules():
        if isinstance(module, Module) and any(True for _ in module.buffers(recurse=False)):
            module._init_self_buffers(buffer_device=next(module.buffers(recurse=False)).device)
