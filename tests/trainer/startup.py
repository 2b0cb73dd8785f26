"""Rank bodies of the policy start-up tests: the gathered weights of a build at any world size, one rank's
host memory while it builds and loads the policy and then saves, exports and streams it, and a refused
plan."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from bench.startup import host_memory, local_parameter_bytes, reset_high_water_mark
from osvl.config import load_recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.trainer.policy import policy_arch


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
    _remove_on_rank0(out / "dcp", rank)  # ~3 GB with AdamW state: gone before the export writes
    record["export"] = peak(lambda: save_pretrained(model, out / "hf", dtype=torch.bfloat16))
    _remove_on_rank0(out / "hf", rank)
    dtype = getattr(torch, recipe.parallel.param_dtype)
    record["sync"] = peak(lambda: stream_buckets(model, dtype, SYNC_BUCKET_BYTES, rank))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def _remove_on_rank0(path: Path, rank: int) -> None:
    """Once every rank has written its part, rank 0 removes ``path`` (the tests' disk stays small)."""
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(path)
    torch.distributed.barrier()


def refused_split_body(rank: int, world: int, overrides: list[str], expected: list[str]) -> None:
    """Building the policy stops with a :class:`CheckpointError` naming each of ``expected``, before the
    model is allocated."""
    from osvl.model import CheckpointError
    from osvl.trainer import policy

    recipe = load_recipe("tiny_sft", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)

    def allocated(*args, **kwargs):
        raise AssertionError("the model was allocated before the plan was checked")

    policy.materialize = allocated
    try:
        policy.build_policy(recipe, arch, world)
    except CheckpointError as error:
        missing = [text for text in expected if text not in str(error)]
        assert not missing, f"{missing} not in: {error}"
    else:
        raise AssertionError("an uneven split was accepted")
