"""Dry-run planner: build the real model on the meta device, apply the parallel plan on a fake
process group of the target world size, and report per-rank memory. Seconds on one CPU.

    python -m osvl.parallel.plan --model qwen3_vl_30b_a3b --world-size 64 --fsdp 64 --ep 8
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from osvl.model.config import Qwen3VLConfig
from osvl.model.presets import PRESETS, preset
from osvl.parallel.parallelize import ParallelConfig, parallelize, sharded_model_config

_SHARDING_DIMS = ("fsdp", "efsdp", "dp_shard")
_BYTES = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class PlanReport:
    model: str
    world_size: int
    dp_shard: int
    tp: int
    ep: int
    total_params: int
    rank0_params: int
    param_bytes: int  # sharded fp32 master weights on rank 0
    grad_bytes: int
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq, fp32
    largest_gather_name: str
    largest_gather_bytes: int  # one FSDP unit all-gathered in param dtype
    tokens_per_rank: int
    activation_bytes: int
    activation_checkpoint: str

    @property
    def steady_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def lines(self) -> list[str]:
        gib = 2**30
        return [
            f"model {self.model}: {self.total_params / 1e9:.2f}B params; world {self.world_size} = "
            f"dp_shard {self.dp_shard} x tp {self.tp} (ep {self.ep})",
            f"per-rank params      {self.rank0_params / 1e6:10.1f} M",
            f"param bytes (fp32)   {self.param_bytes / gib:10.2f} GiB",
            f"grad bytes (fp32)    {self.grad_bytes / gib:10.2f} GiB",
            f"optimizer (AdamW)    {self.optimizer_bytes / gib:10.2f} GiB",
            f"largest all-gather   {self.largest_gather_bytes / gib:10.2f} GiB  ({self.largest_gather_name})",
            f"activations          {self.activation_bytes / gib:10.2f} GiB  "
            f"({self.tokens_per_rank} tokens/rank, AC={self.activation_checkpoint})",
            f"total (steady+act+gather) {(self.steady_state_bytes + self.activation_bytes + 2 * self.largest_gather_bytes) / gib:.2f} GiB",
        ]


def _gathered_numel(p: torch.Tensor) -> int:
    if not isinstance(p, DTensor):
        return p.numel()
    n = p.to_local().numel()
    names = p.device_mesh.mesh_dim_names or ()
    for i, placement in enumerate(p.placements):
        if isinstance(placement, (Shard, _StridedShard)) and i < len(names) and names[i] in _SHARDING_DIMS:
            n *= p.device_mesh.size(i)
    return n


def _largest_gather(model: torch.nn.Module, param_bytes: int) -> tuple[str, int]:
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    best = ("", 0)
    for name, unit in units:
        nested = {id(p) for n, m in units if m is not unit and n.startswith(name) for p in m.parameters()}
        own = [p for p in unit.parameters() if id(p) not in nested]
        size = sum(_gathered_numel(p) for p in own) * param_bytes
        if size > best[1]:
            best = (name or "<root>", size)
    return best


def activation_bytes(arch: Qwen3VLConfig, tokens: int, *, tp: int, ac: str, dtype_bytes: int = 2) -> int:
    """Estimate of saved activations for one packed row of ``tokens`` (text decoder only).

    Per layer without AC: norms and residual (4D), q/k/v/attention out ((2Hq + 2Hkv) hd / tp),
    SwiGLU (3F / tp) or routed experts (top_k * 3F_moe) plus router scores (E, fp32).
    With full AC only each layer input (D) is kept, plus one layer recomputed at a time.
    """
    t = arch.text
    attn = (2 * t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim // tp
    if t.is_moe:
        ffn = t.num_experts_per_tok * 3 * t.moe_intermediate_size + 2 * t.num_experts
    else:
        ffn = 3 * t.intermediate_size // tp
    per_layer = (4 * t.hidden_size + attn + ffn) * tokens * dtype_bytes
    if ac == "full":
        return t.num_hidden_layers * t.hidden_size * tokens * dtype_bytes + per_layer
    return t.num_hidden_layers * per_layer


def plan(
    model: str | Qwen3VLConfig,
    *,
    world_size: int,
    parallel: ParallelConfig,
    tokens_per_rank: int = 16384,
) -> PlanReport:
    """Apply ``parallel`` to the meta model on a fake ``world_size`` group and measure rank 0."""
    arch = preset(model) if isinstance(model, str) else model
    name = model if isinstance(model, str) else "custom"
    if world_size < 1 or tokens_per_rank < 1:
        raise ValueError(f"world_size and tokens_per_rank must be positive, got {world_size}, {tokens_per_rank}")
    if dist.is_initialized():
        raise ValueError("plan() needs a process without a default process group (it creates a fake one)")
    parallel.validate(arch, world_size)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims = parallel.parallel_dims(world_size)
        dims.build_mesh()
        with torch.device("meta"):
            m = sharded_model_config(arch, parallel).build()
        total = sum(p.numel() for p in m.parameters())
        parallelize(m, dims, parallel)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in m.parameters())
        gather_name, gather_bytes = _largest_gather(m, _BYTES[parallel.param_dtype])
    finally:
        dist.destroy_process_group()
    return PlanReport(
        model=name,
        world_size=world_size,
        dp_shard=dims.dp_shard,
        tp=parallel.tp,
        ep=parallel.ep,
        total_params=total,
        rank0_params=local,
        param_bytes=4 * local,
        grad_bytes=4 * local,
        optimizer_bytes=8 * local,
        largest_gather_name=gather_name,
        largest_gather_bytes=gather_bytes,
        tokens_per_rank=tokens_per_rank,
        activation_bytes=activation_bytes(
            arch, tokens_per_rank, tp=parallel.tp, ac=parallel.activation_checkpoint, dtype_bytes=_BYTES[parallel.param_dtype]
        ),
        activation_checkpoint=parallel.activation_checkpoint,
    )


def main(argv: list[str] | None = None) -> PlanReport:
    parser = argparse.ArgumentParser(prog="python -m osvl.parallel.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--fsdp", type=int, default=-1, help="data-parallel shard degree (-1: the rest)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens per rank per micro-step")
    parser.add_argument("--ac", choices=["none", "full", "selective"], default="full")
    parser.add_argument("--param-dtype", choices=sorted(_BYTES), default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    parallel = ParallelConfig(
        dp_shard=args.fsdp, tp=args.tp, ep=args.ep, activation_checkpoint=args.ac, param_dtype=args.param_dtype
    )
    try:
        report = plan(args.model, world_size=args.world_size, parallel=parallel, tokens_per_rank=args.tokens)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(asdict(report), indent=2) if args.json else "\n".join(report.lines()))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
