"""`linear_grpo_loss`: fatal-aware GRPO straight from hidden states, logits never materialised.

Per chunk of tokens: logits_c = hidden_c @ weight.T (input dtype), the token pass turns that
buffer into d(loss)/d(logits_c) in place, then grad_hidden_c = dlogits_c @ weight and
grad_weight += dlogits_c.T @ hidden_c. All three GEMMs run in the forward call, so the step
costs 6·T·H·V FLOPs and backward only scales the stored gradients: fused-linear losses that
recompute the lm_head GEMM in backward pay 8·T·H·V.

Peak extra memory is the two gradients every implementation must return plus one chunk:
[T, H] grad_hidden + [V_local, H] grad_weight (both in the input dtype) + one [chunk, V_local]
logits buffer, which the default chunk keeps <= 1/LOGITS_PER_WEIGHT of the weight's bytes
(so <= 1/8 of grad_weight) once H >= 8 * MIN_CHUNK_ROWS, plus the token pass's per-token vectors
(and, on the torch backend, its cache-sized fp32 block buffers). Half-precision weights
accumulate grad_weight in their own dtype: each chunk's GEMM sums in fp32 and rounds once into
the accumulator, one rounding per chunk instead of one at the end (`grad_weight_accum_dtype=
torch.float32` restores the fp32 accumulator at 2 extra bytes per weight element).
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.distributed as dist

from osvl_kernels.grpo_loss import GRPOLossOutput, grpo_loss_output
from osvl_kernels.inputs import check_linear_inputs, plan_grpo_loss
from osvl_kernels.loss_config import GRPOLossConfig, resolve_loss_config
from osvl_kernels.token_pass import resolve_backend, token_pass
from osvl_kernels.token_results import TokenPassResult
from osvl_kernels.vocab_parallel import vocab_parallel_token_pass, vocab_shard

# Absolute cap on one default chunk of logits, in bytes of the input dtype.
LINEAR_CHUNK_BYTES = 256 * 2**20
# Default chunks keep the logits buffer <= 1/LOGITS_PER_WEIGHT of the [V_local, H] weight's bytes,
# i.e. H / LOGITS_PER_WEIGHT tokens whatever the vocab (512 at H=4096: 32 chunks for 16k tokens).
LOGITS_PER_WEIGHT = 8
# ... but never fewer tokens than this when the byte cap allows: below it the three GEMMs run at a
# fraction of the matmul rate and every chunk re-reads and re-writes all of dW (at H=256, H/8 = 32
# tokens made the CPU step 2.5x slower than the same FLOPs in three large GEMMs).
MIN_CHUNK_ROWS = 128
# Default chunks are a multiple of this many tokens when the budget allows (GEMM-friendly M).
_CHUNK_ALIGN = 128


def lm_head_chunk_rows(vocab_local: int, hidden_size: int, dtype: torch.dtype, chunk_size: int | None = None) -> int:
    """Tokens per chunk: `chunk_size` if given, else H / LOGITS_PER_WEIGHT tokens raised to at least
    MIN_CHUNK_ROWS, within LINEAR_CHUNK_BYTES of [chunk, V_local] logits (rounded down to a multiple
    of 128 when that is >= 128, at least 1)."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int (or None for the default), got {chunk_size!r}")
        return chunk_size
    wanted = max(hidden_size // LOGITS_PER_WEIGHT, MIN_CHUNK_ROWS)
    rows = min(wanted, LINEAR_CHUNK_BYTES // (max(vocab_local, 1) * dtype.itemsize))
    return rows // _CHUNK_ALIGN * _CHUNK_ALIGN if rows >= _CHUNK_ALIGN else max(rows, 1)


def token_chunks(num_tokens: int, chunk_rows: int) -> list[slice]:
    return [slice(start, min(start + chunk_rows, num_tokens)) for start in range(0, num_tokens, chunk_rows)]


def add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with fp32 products and sums, rounded once into acc's dtype; no [V, H] temporary.

    fp32/fp64 accumulators take the GEMM directly. A half accumulator takes, on CUDA, one
    cuBLAS GEMM with beta=1 (fp32 compute and epilogue, one rounding of the sum); CPU GEMMs give
    no such guarantee, so there the product is formed in fp32 a bounded block of rows at a time.
    """
    if acc.dtype == a.dtype and (acc.dtype in (torch.float32, torch.float64) or a.is_cuda):
        acc.addmm_(a, b)
    elif acc.dtype in (torch.float32, torch.float64):
        if a.is_cuda:  # half in, fp32 out, in row blocks so the temporary stays bounded
            block = max(1, LINEAR_CHUNK_BYTES // (4 * max(b.shape[1], 1)))
            for start in range(0, a.shape[0], block):
                acc[start : start + block] += torch.mm(a[start : start + block], b, out_dtype=acc.dtype)
        else:
            acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    else:
        b32 = b.float()
        # fp32 product blocks of <= 1/LOGITS_PER_WEIGHT of the accumulator's bytes.
        block = max(1, acc.shape[0] * acc.element_size() // (4 * LOGITS_PER_WEIGHT))
        for start in range(0, a.shape[0], block):
            acc[start : start + block] += torch.mm(a[start : start + block].float(), b32)


def grad_weight_accum_dtype_for(weight_dtype: torch.dtype, accum_dtype: torch.dtype | None) -> torch.dtype:
    """The dW accumulator's dtype: the weight's by default, or fp32 (fp64 for fp64 weights)."""
    allowed = (weight_dtype, torch.float64 if weight_dtype == torch.float64 else torch.float32)
    dtype = weight_dtype if accum_dtype is None else accum_dtype
    if dtype not in allowed:
        raise ValueError(
            f"grad_weight_accum_dtype must be None, {allowed[0]} or {allowed[1]} for a {weight_dtype} weight, "
            f"got {accum_dtype}"
        )
    return dtype


def concat_results(parts: list[TokenPassResult]) -> TokenPassResult:
    return TokenPassResult(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(TokenPassResult)})


def linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    fatal_step: torch.Tensor | None = None,
    token_step: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    num_seqs: int | torch.Tensor | None = None,
    num_tokens: int | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    inplace_grad: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    grad_weight_accum_dtype: torch.dtype | None = None,
    config: GRPOLossConfig | None = None,
    **settings,
) -> GRPOLossOutput:
    """`grpo_loss` on logits = hidden @ weight.T, computed a chunk of tokens at a time.

    Gradients flow to `hidden` and/or `weight` when they require grad (both are computed in this
    call; backward only scales them). `inplace_grad` is accepted for keyword parity with
    `grpo_loss`: the logits chunk is always a private buffer overwritten by its gradient.

    Tensor parallel (`tp_group`): `weight` is this rank's contiguous vocab shard, every rank
    passes the same tokens and global `target_ids`. Shards are laid out in group-rank order from
    all-gathered sizes (uneven shards are fine), or at the explicit `vocab_start`. The hidden
    gradient is all-reduced (SUM) over the group, so it equals the unsharded gradient: do not
    all-reduce it again in a column-parallel lm_head's backward. The weight gradient is this
    shard's. Loss, log-probs and metrics equal the unsharded computation on every rank.
    `chunk_size` is tokens per chunk; None sizes it from the problem (see `lm_head_chunk_rows`).
    `grad_weight_accum_dtype`: None accumulates dW in the weight's dtype (fp32 inside each
    chunk's GEMM, one rounding per chunk); torch.float32 keeps an fp32 accumulator instead.
    Settings (``config`` and keywords), KL shaping and importance weights: as in `grpo_loss`.
    """
    config = resolve_loss_config("linear_grpo_loss", config, settings)
    backend, validate = config.backend, config.validate
    check_linear_inputs(hidden, weight, target_ids)
    chunk_rows = lm_head_chunk_rows(weight.shape[0], weight.shape[1], hidden.dtype, chunk_size)
    accum_dtype = grad_weight_accum_dtype_for(weight.dtype, grad_weight_accum_dtype)
    resolve_backend(backend, hidden.device)
    hyper = config.hyper
    shard = vocab_shard(weight.shape[0], tp_group, hidden.device, vocab_start, validate)
    T = hidden.shape[0]
    plan = plan_grpo_loss(
        config,
        num_tokens_total=T,
        device=hidden.device,
        target_ids=target_ids,
        vocab_size=shard.vocab_size if shard.vocab_size is not None else shard.start + shard.size,
        cu_seqlens=cu_seqlens,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        rewards=rewards,
        group_ids=group_ids,
        fatal_step=fatal_step,
        token_step=token_step,
        advantages=advantages,
        ref_logprobs=ref_logprobs,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        is_weights=is_weights,
        behavior_logprobs=behavior_logprobs,
    )
    old = None if old_logprobs is None else old_logprobs.detach()
    ref = None if ref_logprobs is None else ref_logprobs.detach()
    want_hidden, want_weight = hidden.requires_grad, weight.requires_grad
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if want_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device) if want_weight else None
    parts = []
    with torch.no_grad():
        h, w = hidden.detach(), weight.detach()
        buffer = torch.empty(min(chunk_rows, T), w.shape[0], dtype=w.dtype, device=w.device)
        logits = grad = None
        for rows in token_chunks(T, chunk_rows):
            logits = torch.mm(h[rows], w.t(), out=buffer[: rows.stop - rows.start])
            grad = logits if (want_hidden or want_weight) else None
            old_c = None if old is None else old[rows]
            ref_c = None if ref is None else ref[rows]
            token_weight, advantage = plan.weight[rows], plan.token_advantage[rows]
            if tp_group is None:
                part = token_pass(
                    logits, target_ids[rows], token_weight, advantage, old_c, ref_c, hyper, grad, backend=backend
                )
            else:
                part = vocab_parallel_token_pass(
                    logits,
                    target_ids[rows],
                    shard.start,
                    token_weight,
                    advantage,
                    old_c,
                    ref_c,
                    hyper,
                    grad,
                    tp_group,
                    backend=backend,
                )
            parts.append(part)
            if want_hidden:
                torch.mm(logits, w, out=grad_hidden[rows])
            if want_weight:
                add_matmul_(grad_weight, logits.t(), h[rows])
        del buffer, logits, grad  # the chunk (and its views) is dead: keep it out of the dW cast's peak
        if want_hidden and tp_group is not None:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=tp_group)
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
    return grpo_loss_output(concat_results(parts), plan, old_logprobs, [hidden, weight], [grad_hidden, grad_weight])
