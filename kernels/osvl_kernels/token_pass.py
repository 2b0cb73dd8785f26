"""The token pass: per-row log-softmax statistics, the GRPO token objective and the closed-form
logits gradient, over packed rows.

The gradient is closed-form once the per-token weights are known (they come from the plan), so
the pass writes d(loss)/d(logits) while it still has the row at hand: no separate backward that
re-reads the logits. Two shapes of the same computation:

* `token_pass`: everything for rows that hold the whole vocabulary (one Triton launch).
* `row_stats` -> (all-reduce across vocab shards) -> `finish_stats` -> `token_terms` ->
  `grad_from_stats`: the vocab-parallel split, where a rank holds a contiguous vocab shard
  [vocab_start, vocab_start + V_local) and only a few fp32 numbers per token cross ranks.

Backends: "triton" (CUDA, or CPU under TRITON_INTERPRET=1) and "torch" (cache-sized blocks of rows in
three reused fp32 buffers: every pass after the first read of a block runs from cache).
All statistics are over z' = logits / temperature, in fp32.
"""

from __future__ import annotations

import os
from dataclasses import fields

import torch

from osvl_kernels.loss_config import LossHyper
from osvl_kernels.objective import TokenTerms, token_terms
from osvl_kernels.token_results import RowStats, TokenPassResult
from osvl_kernels.triton_token_pass import grad_from_stats_triton, row_stats_triton, token_pass_triton

# The torch backend's fp32 working set (bytes): at most three [rows, V] buffers reused block after block
# (usually one or two are needed). Small enough to stay in cache, so the several passes over a block cost
# one read of the logits from memory; large enough that per-op overheads stay small.
TORCH_CHUNK_BYTES = 6 * 2**20


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'torch'")
    if backend != "auto":
        return backend
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"


def chunk_rows(vocab_size: int, budget_bytes: int | None = None) -> int:
    """Rows per block so that the torch backend's three fp32 [rows, V] buffers stay within the budget
    (TORCH_CHUNK_BYTES, read at call time so a benchmark can scale it with its problem)."""
    budget = TORCH_CHUNK_BYTES if budget_bytes is None else budget_bytes
    return max(1, budget // (3 * 4 * max(vocab_size, 1)))


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
        return token_pass_triton(logits, target_ids, weight, advantage, old_logprobs, ref_logprobs, hyper, grad_out)
    return token_pass_torch(logits, target_ids, weight, advantage, old_logprobs, ref_logprobs, hyper, grad_out)


FP32_MIN = torch.finfo(torch.float32).min
FP32_MAX = torch.finfo(torch.float32).max


class Blocks:
    """Cache-sized blocks of rows and the torch backend's fp32 [rows, V] working buffers, allocated on
    first use and reused by every block: a scaled copy of the logits (when they are not fp32 at
    temperature 1), the probabilities (when they cannot go straight into the gradient rows) and a
    scratch for products. The first read of a block brings it into cache; the passes after it
    (softmax, argmax, dot, gradient) run from there."""

    def __init__(self, logits: torch.Tensor) -> None:
        T, V = logits.shape
        self.rows = min(chunk_rows(V), max(T, 1))
        self.shape, self.device = (self.rows, V), logits.device
        self.buffers: dict[str, torch.Tensor] = {}

    def ranges(self, num_rows: int) -> list[slice]:
        return [slice(start, min(start + self.rows, num_rows)) for start in range(0, num_rows, self.rows)]

    def buffer(self, name: str, num_rows: int) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return self.buffers[name][:num_rows]

    def scaled(self, logits_rows: torch.Tensor, temperature: float) -> tuple[torch.Tensor, bool]:
        """(z' = logits / temperature in fp32, whether z' is a private copy): the rows themselves when
        they already are that, else a copy in the `scaled` buffer."""
        if logits_rows.dtype == torch.float32 and temperature == 1.0:
            return logits_rows, False
        z = self.buffer("scaled", logits_rows.shape[0]).copy_(logits_rows)
        return (z if temperature == 1.0 else z.div_(temperature)), True


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def softmax_block(z: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out = softmax(z) over the row; returns (row max, log-sum-exp). At the row's argmax the probability
    is exp(max - lse) = 1 / sum_j exp(z_j - max), so lse needs no second exp pass over the row."""
    torch.softmax(z, dim=-1, out=out)
    top = out.argmax(dim=-1, keepdim=True)
    m = z.gather(1, top).squeeze(1)
    return m, m - torch.log(out.gather(1, top).squeeze(1))


def expected_logit(probs: torch.Tensor, z: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
    """sum_j p_j z_j per row with fp32 accumulation, the products formed in `product` (which may be z
    itself: then z is consumed). Entries at -inf, where p is 0, count 0 rather than nan."""
    if z.device.type != "cpu":  # no host read off the CPU: always take the finite copy
        torch.clamp(z, min=FP32_MIN, out=product)
        return product.mul_(probs).sum(dim=-1)
    dots = torch.mul(probs, z, out=product).sum(dim=-1)
    bad = torch.isnan(dots).nonzero().squeeze(1)  # on CPU the host read is free
    if bad.numel():  # 0 * -inf at a masked vocab entry is nan: those entries count 0, any other nan stays
        dots[bad] = torch.where(probs[bad] == 0, 0.0, product[bad]).sum(dim=-1)
    return dots


def zero_rows_(x: torch.Tensor, rows: torch.Tensor) -> None:
    """x[rows] = 0 for a bool row mask; on CPU only the listed rows are touched."""
    if x.device.type == "cpu":
        listed = rows.nonzero().squeeze(1)
        if listed.numel():
            x.index_fill_(0, listed, 0.0)
    else:
        x.masked_fill_(rows[:, None], 0.0)


def write_grad_block(
    probs: torch.Tensor,
    z: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    coef_logp: torch.Tensor,
    coef_entropy: torch.Tensor,
    local_target: torch.Tensor,
    in_shard: torch.Tensor,
    zero_rows: torch.Tensor,
    temperature: float,
    has_entropy: bool,
    scratch: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out = (coef_logp * (onehot - p) + coef_entropy * p * (log p + H)) / T° for one block of rows, computed in
    place in `probs` (fp32; may be `out` itself), with log p = z' - lse. Rows in `zero_rows` are written as
    exact zeros whatever their logits held. `has_entropy` False promises coef_entropy == 0 (z' and `scratch`
    are then not read; `scratch` may be z' itself)."""
    inv_t = 1.0 / temperature
    if has_entropy:
        # p * (ce * (z' - lse + H) - c) / T°, with the factor clamped finite so that p == 0 entries stay 0.
        ce = coef_entropy * inv_t
        offset = ce * (entropy - lse) - coef_logp * inv_t
        factor = torch.mul(z, ce[:, None], out=scratch).add_(offset[:, None]).clamp_(FP32_MIN, FP32_MAX)
        probs.mul_(factor)
    else:
        probs.mul_((coef_logp * -inv_t)[:, None])
    onehot = torch.where(in_shard, coef_logp * inv_t, torch.zeros_like(coef_logp))
    probs.scatter_add_(1, local_target[:, None], onehot[:, None])
    zero_rows_(probs, zero_rows)
    if out.data_ptr() != probs.data_ptr():
        out.copy_(probs)


def token_pass_torch(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    weight: torch.Tensor,
    advantage: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    hyper: LossHyper,
    grad_out: torch.Tensor | None,
) -> TokenPassResult:
    """The torch backend of `token_pass`: one read of the logits. Per block of rows (sized to stay in
    cache): the fp32 softmax, the target's log-prob and the entropy, the token objective, and the
    gradient written into `grad_out` while the block is still in cache."""
    T, V = logits.shape
    valid = weight > 0
    target = target_ids.long().clamp(0, max(V - 1, 0))
    in_vocab = (target_ids >= 0) & (target_ids < V)
    has_entropy = hyper.entropy_coef != 0.0
    aliased = grad_out is not None and shares_memory(grad_out, logits)  # the logits are consumed
    # The probabilities go straight into the gradient rows unless those alias the logits still being read.
    probs_into_out = grad_out is not None and grad_out.dtype == torch.float32 and not aliased
    blocks = Blocks(logits)
    logps, entropies, terms_parts = [], [], []
    for rows in blocks.ranges(T):
        n = rows.stop - rows.start
        z, private = blocks.scaled(logits[rows], hyper.temperature)
        disposable = private or aliased  # z' may be overwritten once read
        probs = grad_out[rows] if probs_into_out else blocks.buffer("probs", n)
        _, lse = softmax_block(z, probs)
        logp = (z.gather(1, target[rows, None]).squeeze(1) - lse).clamp_max(0.0)
        product = z if disposable and not has_entropy else blocks.buffer("scratch", n)
        entropy = lse - expected_logit(probs, z, product)
        terms = token_terms(logp, advantage[rows], _rows(old_logprobs, rows), _rows(ref_logprobs, rows), hyper)
        if grad_out is not None:
            # Invalid rows were computed like the others (whatever they hold): their coefficients are 0.
            row_weight, row_valid = weight[rows], valid[rows]
            coef_logp = torch.where(row_valid, row_weight * terms.dloss_dlogp, 0.0)
            coef_entropy = torch.where(row_valid, row_weight * hyper.entropy_coef, 0.0)
            write_grad_block(
                probs,
                z,
                lse,
                entropy,
                coef_logp,
                coef_entropy,
                target[rows],
                in_vocab[rows],
                (coef_logp == 0) & (coef_entropy == 0),
                hyper.temperature,
                has_entropy,
                z if disposable else blocks.buffer("scratch", n),
                grad_out[rows],
            )
        logps.append(logp)
        entropies.append(entropy)
        terms_parts.append(terms)
    if T == 0:
        logp = torch.zeros(0, dtype=torch.float32, device=logits.device)
        return result_from_terms(valid, logp, logp, token_terms(logp, advantage.float(), None, None, hyper), hyper)
    terms = TokenTerms(**{f.name: torch.cat([getattr(t, f.name) for t in terms_parts]) for f in fields(TokenTerms)})
    return result_from_terms(valid, torch.cat(logps), torch.cat(entropies), terms, hyper)


def _rows(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[rows]


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
    local_target = local_target.clamp(0, V - 1)
    blocks = Blocks(logits)
    for rows in blocks.ranges(T):
        n = rows.stop - rows.start
        z, private = blocks.scaled(logits[rows], temperature)
        probs = blocks.buffer("probs", n)
        m, lse = softmax_block(z, probs)
        tgt = z.gather(1, local_target[rows, None]).squeeze(1)
        empty = m == float("-inf")  # the row is all -inf in this shard: the empty-sum identity
        sumexp = torch.where(empty, 0.0, torch.exp(lse - m))
        dots = expected_logit(probs, z, z if private else blocks.buffer("scratch", n))
        zexp = torch.where(empty, 0.0, sumexp * dots)
        ok = valid[rows]
        out.max[rows] = torch.where(ok, m, out.max[rows])
        out.sumexp[rows] = torch.where(ok, sumexp, out.sumexp[rows])
        out.zexp[rows] = torch.where(ok, zexp, out.zexp[rows])
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
        grad_from_stats_triton(
            logits, target_ids, vocab_start, lse, entropy, coef_logp, coef_entropy, temperature, grad_out
        )
        return
    T, V = logits.shape
    if V == 0:
        return
    local_target = target_ids.long() - vocab_start
    in_shard = (local_target >= 0) & (local_target < V)
    local_target = local_target.clamp(0, V - 1)
    aliased = shares_memory(grad_out, logits)
    probs_into_out = grad_out.dtype == torch.float32 and not aliased
    # Reading the coefficients on the host is free on CPU; elsewhere take the general formula, no sync.
    has_entropy = logits.device.type != "cpu" or bool((coef_entropy != 0).any())
    blocks = Blocks(logits)
    for rows in blocks.ranges(T):
        n = rows.stop - rows.start
        z, private = blocks.scaled(logits[rows], temperature)
        probs = grad_out[rows] if probs_into_out else blocks.buffer("probs", n)
        m, shard_lse = softmax_block(z, probs)
        probs.mul_(torch.exp(shard_lse - lse[rows])[:, None])  # this shard's softmax -> the global one
        inactive = (coef_logp[rows] == 0) & (coef_entropy[rows] == 0)
        write_grad_block(
            probs,
            z,
            lse[rows],
            entropy[rows],
            coef_logp[rows],
            coef_entropy[rows],
            local_target[rows],
            in_shard[rows],
            inactive | (m == float("-inf")),
            temperature,
            has_entropy,
            z if private or aliased else blocks.buffer("scratch", n),
            grad_out[rows],
        )
