"""Rank bodies and a checkpoint writer for the policy start-up tests: the gathered weights of a build at
any world size, and one rank's host memory while it builds and loads the policy."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import time
from pathlib import Path

import torch

from osvl.config import load_recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.model import Qwen3VLConfig, build_model, config_to_hf, hf_tensor_specs, shard_plan
from osvl.model.checkpoint import INDEX_FILE
from osvl.trainer.policy import policy_arch, tiny_arch

GIB = 2**30


def host_memory() -> dict[str, int]:
    """This process's resident bytes now and its high-water mark (``/proc/self/status``)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def reset_high_water_mark() -> int:
    """Frees what the allocator holds, resets VmHWM to the current RSS (Linux ``clear_refs`` 5) and
    returns that RSS: the baseline growth is measured from."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return host_memory()["VmRSS"]


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """float32 bytes of this rank's shards (each parameter once)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += (p.to_local() if isinstance(p, DTensor) else p).numel() * 4
    return total


def gathered_weights_body(rank: int, world: int, overrides: list[str], out: str) -> None:
    """Builds the policy under ``overrides`` and saves the whole gathered state (rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from osvl.trainer.policy import build_policy

    recipe = load_recipe("tiny_sft", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    model = build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, out)


SYNC_BUCKET_BYTES = 64 * 2**20


def stream_buckets(model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, rank: int) -> int:
    """The distributed weight sync's host side without a server: every rank gathers every unit, rank 0
    holds a bucket of HF tensors until it is full (where the sync would send it). Returns the bytes."""
    from osvl.model import iter_hf_tensors

    bucket, size, total = [], 0, 0
    for _, tensor in iter_hf_tensors(model, dtype):
        if rank != 0:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
        total += nbytes
    return total


def host_memory_body(rank: int, world: int, overrides: list[str], out_dir: str) -> None:
    """One rank's host high-water mark (growth over the process before the model existed) while the
    policy is built and loaded, and then during a DCP save with AdamW state, an HF export and a
    bucketed weight stream: what the dry run's host memory plan predicts."""
    from osvl.model import save_pretrained
    from osvl.trainer.checkpoint import save_checkpoint
    from osvl.trainer.optim import build_optimizer
    from osvl.trainer.policy import build_policy

    recipe = load_recipe("tiny_sft", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    baseline = reset_high_water_mark()
    start = time.perf_counter()
    model = build_policy(recipe, arch, world)
    seconds = time.perf_counter() - start
    record = {
        "rank": rank,
        "world": world,
        "seconds": seconds,
        "baseline_rss": baseline,
        "startup": host_memory()["VmHWM"] - baseline,
        "shard_bytes": local_parameter_bytes(model),
        "total_params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, recipe.optimizer)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments exist, as at any checkpoint
    optimizer.zero_grad(set_to_none=True)

    def peak(phase) -> int:
        reset_high_water_mark()
        phase()
        return host_memory()["VmHWM"] - baseline

    out = Path(out_dir)
    record["save"] = peak(lambda: save_checkpoint(out / "dcp", 1, model, optimizer, {}, keep_last=1))
    record["export"] = peak(lambda: save_pretrained(model, out / "hf", dtype=torch.bfloat16))
    dtype = getattr(torch, recipe.parallel.param_dtype)
    record["sync"] = peak(lambda: stream_buckets(model, dtype, SYNC_BUCKET_BYTES, rank))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def large_arch(vocab_size: int, special, *, hidden: int = 1024, layers: int = 16) -> Qwen3VLConfig:
    """A Qwen3-VL of ~270M parameters whose vocabulary follows the tokenizer's ids (padded to 32768)."""
    arch = tiny_arch(vocab_size, special)
    text = dataclasses.replace(
        arch.text,
        vocab_size=max(32768, vocab_size),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        mrope_section=(16, 8, 8),
    )
    vision = dataclasses.replace(arch.vision, out_hidden_size=hidden)
    return dataclasses.replace(arch, text=text, vision=vision)


def write_checkpoint(arch: Qwen3VLConfig, path: Path, *, max_shard_bytes: int = 256 * 2**20, seed: int = 0) -> int:
    """An HF checkpoint of ``arch`` in bfloat16 written file by file (never the whole model in memory);
    values are seeded normals. Returns the parameter count."""
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, device="meta")
    specs = hf_tensor_specs(model, torch.bfloat16)
    plan = shard_plan(specs, 1, max_shard_bytes)
    by_name = {s.name: s for s in specs}
    generator = torch.Generator().manual_seed(seed)
    from safetensors.torch import save_file

    for file in plan:
        tensors = {
            name: (torch.randn(by_name[name].shape, generator=generator) * 0.02).to(torch.bfloat16)
            for name in file.tensors
        }
        save_file(tensors, str(path / file.name), metadata={"format": "pt"})
        del tensors
    (path / "config.json").write_text(json.dumps(config_to_hf(arch, dtype="bfloat16"), indent=2))
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(f.nbytes for f in plan)},
            "weight_map": {n: f.name for f in plan for n in f.tensors},
        }
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return sum(math.prod(s.shape) for s in specs)
