"""The token pass: per-row log-softmax statistics, the GRPO token objective and the closed-form
logits gradient, over packed rows.

The gradient is closed-form once the per-token weights are known (they come from the plan), so
the pass writes d(loss)/d(logits) while it still has the row at hand: no separate backward that
re-reads the logits. Two shapes of the same computation:

* `token_pass`: everything for rows that hold the whole vocabulary (one Triton launch).
* `row_stats` -> (all-reduce across vocab shards) -> `finish_stats` -> `token_terms` ->
  `grad_from_stats`: the vocab-parallel split, where a rank holds a contiguous vocab shard
  [vocab_start, vocab_start + V_local) and only a few fp32 numbers per token cross ranks.

Backends: "triton" (CUDA, or CPU under TRITON_INTERPRET=1) and "torch" (memory-bounded chunks).
All statistics are over z' = logits / temperature, in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from osvl_kernels.inputs import LossHyper
from osvl_kernels.objective import TokenTerms

# fp32 working set of one chunk of rows in the torch backend (bytes); bounds its peak memory.
TORCH_CHUNK_BYTES = 64 * 2**20


@dataclass
class TokenPassResult:
    """Per-token outputs (fp32/bool, [T]); rows with weight 0 hold zeros."""

    logp: torch.Tensor
    entropy: torch.Tensor
    loss: torch.Tensor  # unweighted per-token objective incl. KL and entropy terms
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    kl: torch.Tensor


@dataclass
class RowStats:
    """Partial log-softmax statistics of each row over the vocab entries a rank holds."""

    max: torch.Tensor  # [T] max_j z'_j (-inf for an empty shard)
    sumexp: torch.Tensor  # [T] sum_j exp(z'_j - max)
    zexp: torch.Tensor  # [T] sum_j exp(z'_j - max) * z'_j   (for the entropy)
    target: torch.Tensor  # [T] z'_target if the target lies in this shard, else 0


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'torch'")
    if backend != "auto":
        return backend
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"


def chunk_rows(vocab_size: int, budget_bytes: int | None = None) -> int:
    """Rows per chunk so that four fp32 [rows, V] temporaries stay within the budget
    (TORCH_CHUNK_BYTES, read at call time so a benchmark can scale it with its problem)."""
    budget = TORCH_CHUNK_BYTES if budget_bytes is None else budget_bytes
    return max(1, budget // (4 * 4 * max(vocab_size, 1)))


def finish_stats(stats: RowStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, target log-prob clamped <= 0, entropy) from whole-vocab statistics."""
    lse = stats.max + torch.log(stats.sumexp)
    logp = (stats.target - lse).clamp_max(0.0)
    entropy = lse - stats.zexp / stats.sumexp
    return lse, logp, entropy


def result_from_terms(
    valid: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor, terms: TokenTerms, hyper: LossHyper
) -> TokenPassResult:
    zero = torch.zeros_like(logp)
    return TokenPassResult(
        logp=torch.where(valid, logp, zero),
        entropy=torch.where(valid, entropy, zero),
        loss=torch.where(valid, terms.loss - hyper.entropy_coef * entropy, zero),
        ratio=torch.where(valid, terms.ratio, zero),
        clipped=terms.clipped & valid,
        dual_clipped=terms.dual_clipped & valid,
        kl=torch.where(valid, terms.kl, zero),
    )


def token_pass(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    weight: torch.Tensor,
    advantage: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    hyper: LossHyper,
    grad_out: torch.Tensor | None,
    backend: str = "auto",
) -> TokenPassResult:
    """Whole-vocab rows. When `grad_out` is given ([T, V], may alias `logits`) it receives
    weight_t * d(loss_t)/d(logits_t), with zero rows where weight is 0 (the invalid rows)."""
    if resolve_backend(backend, logits.device) == "triton":
        from osvl_kernels.triton_token_pass import token_pass_triton

        return token_pass_triton(
            logits, target_ids, weight, advantage, old_logprobs, ref_logprobs, hyper, grad_out
        )
    # The torch backend runs the split stages over one shard that is the whole vocabulary.
    from osvl_kernels.vocab_parallel import vocab_parallel_token_pass

    return vocab_parallel_token_pass(
        logits, target_ids, 0, weight, advantage, old_logprobs, ref_logprobs, hyper, grad_out, None, backend="torch"
    )


def row_stats(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    valid: torch.Tensor,
    vocab_start: int,
    temperature: float,
    backend: str = "auto",
) -> RowStats:
    """Statistics of each valid row over this shard; rows where `valid` is False are skipped
    (their fields hold max=0, sumexp=1, zexp=0, target=0 so downstream math stays finite).
    A valid row whose shard is empty or all -inf holds max=-inf, sumexp=0, zexp=0."""
    if resolve_backend(backend, logits.device) == "triton":
        from osvl_kernels.triton_token_pass import row_stats_triton

        return row_stats_triton(logits, target_ids, valid, vocab_start, temperature)
    T, V = logits.shape
    out = RowStats(*(torch.zeros(T, dtype=torch.float32, device=logits.device) for _ in range(4)))
    # Valid rows of a shard with nothing in it (or only -inf) hold the empty-sum identity.
    out.max.copy_(torch.where(valid, float("-inf"), 0.0))
    out.sumexp.copy_((~valid).float())
    if V == 0:
        return out
    local_target = target_ids.long() - vocab_start
    in_shard = valid & (local_target >= 0) & (local_target < V)
    step = chunk_rows(V)
    for start in range(0, T, step):
        rows = slice(start, min(start + step, T))
        z = logits[rows].float() / temperature
        m = z.max(dim=-1).values
        e = torch.exp(z - torch.where(torch.isfinite(m), m, 0.0)[:, None])
        ez = torch.where(e > 0, e * z, torch.zeros_like(e))  # exp(-inf) * -inf would be nan
        tgt = z.gather(1, local_target[rows].clamp(0, V - 1)[:, None]).squeeze(1)
        ok = valid[rows]
        out.max[rows] = torch.where(ok, m, out.max[rows])
        out.sumexp[rows] = torch.where(ok, e.sum(dim=-1), out.sumexp[rows])
        out.zexp[rows] = torch.where(ok, ez.sum(dim=-1), out.zexp[rows])
        out.target[rows] = torch.where(in_shard[rows], tgt, out.target[rows])
    return out


def grad_from_stats(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    coef_logp: torch.Tensor,
    coef_entropy: torch.Tensor,
    temperature: float,
    grad_out: torch.Tensor,
    backend: str = "auto",
) -> None:
    """grad_out[t, j] = (coef_logp[t] * (onehot_j - p_j) + coef_entropy[t] * p_j * (log p_j + H_t)) / T°
    for this shard's columns, where p = softmax(logits / temperature) with the global `lse`.
    Rows with coef_logp == coef_entropy == 0 are written as zeros. `grad_out` may alias `logits`."""
    if resolve_backend(backend, logits.device) == "triton":
        from osvl_kernels.triton_token_pass import grad_from_stats_triton

        grad_from_stats_triton(
            logits, target_ids, vocab_start, lse, entropy, coef_logp, coef_entropy, temperature, grad_out
        )
        return
    T, V = logits.shape
    local_target = target_ids.long() - vocab_start
    in_shard = (local_target >= 0) & (local_target < V)
    step = chunk_rows(V)
    for start in range(0, T, step):
        rows = slice(start, min(start + step, T))
        logp_all = logits[rows].float() / temperature - lse[rows, None]
        probs = logp_all.exp()
        finite_logp = torch.where(probs > 0, logp_all, torch.zeros_like(logp_all))
        g_logp = coef_logp[rows, None]
        grad = probs * (coef_entropy[rows, None] * (finite_logp + entropy[rows, None]) - g_logp)
        onehot = torch.where(in_shard[rows], coef_logp[rows], torch.zeros_like(coef_logp[rows]))
        grad.scatter_add_(1, local_target[rows].clamp(0, V - 1)[:, None], onehot[:, None])
        active = (coef_logp[rows] != 0) | (coef_entropy[rows] != 0)
        grad = torch.where(active[:, None], grad / temperature, torch.zeros_like(grad))
        grad_out[rows] = grad.to(grad_out.dtype)
