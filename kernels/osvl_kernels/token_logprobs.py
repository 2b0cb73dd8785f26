"""No-grad fp32 token log-probs (and entropies) for the old and reference policies.

Reuses the token pass's row statistics, so there is never an fp32 [T, V] copy of the logits, and
the vocab-parallel all-reduce when the logits (or the lm_head weight) are a vocab shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from osvl_kernels.inputs import check_linear_inputs, check_logits_inputs
from osvl_kernels.linear_grpo_loss import lm_head_chunk_rows, token_chunks
from osvl_kernels.token_pass import finish_stats, resolve_backend, row_stats
from osvl_kernels.vocab_parallel import all_reduce_row_stats, vocab_shard


def _check_options(temperature: float, backend: str, device: torch.device) -> None:
    if not (isinstance(temperature, (int, float)) and 0.0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    resolve_backend(backend, device)


def _check_targets(target_ids: torch.Tensor, vocab_size: int) -> None:
    if target_ids.numel() and not bool(((target_ids >= 0) & (target_ids < vocab_size)).all()):
        raise ValueError(f"every target_id must be in [0, {vocab_size}) (token_logprobs scores every row)")


def _shard_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_start: int,
    temperature: float,
    group: dist.ProcessGroup | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    every_row = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    stats = row_stats(logits, target_ids, every_row, vocab_start, temperature, backend=backend)
    if group is not None:
        stats = all_reduce_row_stats(stats, group)
    _, logp, entropy = finish_stats(stats)
    return logp, entropy


def token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    vocab_start: int | None = None,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[t, target_ids[t]] for every row, fp32 [T], no grad.

    With `tp_group`, `logits` is this rank's contiguous vocab shard (laid out as in
    `linear_grpo_loss`) and the result is the full-vocab log-prob on every rank.
    `validate=False` skips the target range check (a host sync).
    """
    check_logits_inputs(logits, target_ids)
    _check_options(temperature, backend, logits.device)
    shard = vocab_shard(logits.shape[1], tp_group, logits.device, vocab_start, validate)
    if validate:
        _check_targets(target_ids, shard.vocab_size)
    with torch.no_grad():
        logp, entropy = _shard_logprobs(logits.detach(), target_ids, shard.start, temperature, tp_group, backend)
    return (logp, entropy) if return_entropy else logp


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    vocab_start: int | None = None,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` of logits = hidden @ weight.T, one bounded chunk of tokens at a time."""
    check_linear_inputs(hidden, weight, target_ids)
    chunk_rows = lm_head_chunk_rows(weight.shape[0], weight.shape[1], hidden.dtype, chunk_size)
    _check_options(temperature, backend, hidden.device)
    shard = vocab_shard(weight.shape[0], tp_group, hidden.device, vocab_start, validate)
    if validate:
        _check_targets(target_ids, shard.vocab_size)
    T = hidden.shape[0]
    logp = torch.empty(T, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logp)
    with torch.no_grad():
        h, w = hidden.detach(), weight.detach()
        buffer = torch.empty(min(chunk_rows, T), w.shape[0], dtype=w.dtype, device=w.device)
        for rows in token_chunks(T, chunk_rows):
            logits = torch.mm(h[rows], w.t(), out=buffer[: rows.stop - rows.start])
            logp[rows], entropy[rows] = _shard_logprobs(
                logits, target_ids[rows], shard.start, temperature, tp_group, backend
            )
    return (logp, entropy) if return_entropy else logp
