"""Vocab-parallel (tensor-parallel lm_head) log-softmax: each rank holds a contiguous vocab shard.

Only a few fp32 numbers per token cross ranks: one MAX all-reduce of the row max, then one SUM
all-reduce of [T, 3] = (sum-exp and z-weighted sum-exp rescaled to the global max, target logit;
only the rank that owns the target contributes a non-zero target). Everything after that
(log-prob, entropy, the GRPO objective) is computed identically on every rank, so each rank
writes the gradient of its own shard with no further communication.

Every rank of the group must call these functions with the same tokens (same T and the same
per-token inputs); only the logits/weight shard differs. A ValueError raised on one rank only
(local inputs) leaves the others waiting in the next collective, as with any collective code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from osvl_kernels.loss_config import LossHyper
from osvl_kernels.objective import token_terms
from osvl_kernels.token_pass import (
    finish_stats,
    grad_from_stats,
    result_from_terms,
    row_stats,
)
from osvl_kernels.token_results import RowStats, TokenPassResult


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's rows sit in the global vocabulary."""

    start: int
    size: int
    vocab_size: int | None  # global V; None only when `vocab_start` was given and validation is off


def vocab_shard(
    local_size: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    vocab_start: int | None = None,
    validate: bool = True,
) -> VocabShard:
    """Resolves this rank's vocab range.

    Without `vocab_start` the shard sizes are all-gathered (one tiny collective and a host read)
    and shards are laid out in group-rank order, so uneven shards just work. With `vocab_start`
    and `validate=False` nothing is communicated; with `validate=True` the given ranges are
    checked to tile [0, V) exactly once.
    """
    if group is None:
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start={vocab_start} needs tp_group (without it the weight is the whole vocab)")
        return VocabShard(0, local_size, local_size)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("tp_group was given but torch.distributed is not initialised")
    if vocab_start is not None:
        if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
            raise ValueError(f"vocab_start must be an int >= 0, got {vocab_start!r}")
        if not validate:
            return VocabShard(vocab_start, local_size, None)
    mine = torch.tensor([-1 if vocab_start is None else vocab_start, local_size], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    starts, sizes = zip(*(tuple(int(v) for v in pair.tolist()) for pair in gathered))
    rank = dist.get_rank(group)
    total = sum(sizes)
    if all(s == -1 for s in starts):
        return VocabShard(sum(sizes[:rank]), local_size, total)
    if any(s == -1 for s in starts):
        raise ValueError("pass vocab_start on every rank of tp_group or on none")
    covered = sorted(zip(starts, sizes))
    end = 0
    for start, size in covered:
        if start != end:
            raise ValueError(f"vocab shards {covered} (start, size) must tile [0, {total}) without gaps or overlaps")
        end = start + size
    return VocabShard(vocab_start, local_size, total)


def all_reduce_row_stats(stats: RowStats, group: dist.ProcessGroup) -> RowStats:
    """Whole-vocab statistics from every rank's shard statistics (two all-reduces)."""
    global_max = stats.max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    # A shard whose row is all -inf (padded vocab) has max = -inf and contributes nothing.
    scale = torch.exp(stats.max - global_max)
    contributes = scale > 0
    zero = torch.zeros_like(scale)
    packed = torch.stack(
        [
            torch.where(contributes, stats.sumexp * scale, zero),
            torch.where(contributes, stats.zexp * scale, zero),
            stats.target,
        ],
        dim=1,
    )
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return RowStats(max=global_max, sumexp=packed[:, 0], zexp=packed[:, 1], target=packed[:, 2])


def vocab_parallel_token_pass(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_start: int,
    weight: torch.Tensor,
    advantage: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    hyper: LossHyper,
    grad_out: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    backend: str = "auto",
) -> TokenPassResult:
    """`token_pass` for a vocab shard [vocab_start, vocab_start + V_local) of each row.

    Returns the same per-token result on every rank; `grad_out` (may alias `logits`) receives
    this shard's columns of weight_t * d(loss_t)/d(logits_t). `group=None` means the shard is
    the whole vocabulary (no collective): the torch backend of `token_pass`.
    """
    valid = weight > 0
    stats = row_stats(logits, target_ids, valid, vocab_start, hyper.temperature, backend=backend)
    if group is not None:
        stats = all_reduce_row_stats(stats, group)
    lse, logp, entropy = finish_stats(stats)
    terms = token_terms(logp, advantage, old_logprobs, ref_logprobs, hyper)
    if grad_out is not None:
        grad_from_stats(
            logits,
            target_ids,
            vocab_start,
            lse,
            entropy,
            weight * terms.dloss_dlogp,
            weight * hyper.entropy_coef,
            hyper.temperature,
            grad_out,
            backend=backend,
        )
    return result_from_terms(valid, logp, entropy, terms, hyper)
