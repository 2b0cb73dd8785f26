"""One packed GRPO micro-batch, and the padded and one-row-per-token layouts other libraries take.

Every case computes the same objective on the same numbers: token-level PPO clipping with
precomputed per-sequence advantages, aggregated seq-mean-token-mean, no KL/entropy terms.
Sequence lengths vary (0.5x..1.5x the mean), so the padded layout carries real padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS_LOW = 0.2
EPS_HIGH = 0.28
# Rows per lm_head matmul when the harness builds logits; the logits cases and the float64
# reference both use it, so they see bit-identical logits (a different split may round differently).
LOGITS_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class Shape:
    num_tokens: int
    vocab: int
    hidden: int
    num_seqs: int
    dtype: str  # key of DTYPES

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("num_tokens", "vocab", "hidden", "num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_seqs > self.num_tokens:
            raise ValueError(f"num_seqs ({self.num_seqs}) must be <= num_tokens ({self.num_tokens})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class Workload:
    """Packed inputs; `hidden`/`weight` produce `logits` (logits = hidden @ weight.T)."""

    shape: Shape
    cu_seqlens: torch.Tensor  # [S+1] int32
    lengths: list[int]
    target_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    old_logprobs: torch.Tensor  # [T] fp32: current log-probs plus noise, so ratios stay near 1
    advantages: torch.Tensor  # [S] fp32
    token_weight: torch.Tensor  # [T] fp32: seq-mean-token-mean weight of each valid token
    hidden: torch.Tensor  # [T, H]
    weight: torch.Tensor  # [V, H]

    def logits(self) -> torch.Tensor:
        """[T, V] in the workload dtype, built LOGITS_CHUNK_ROWS rows at a time."""
        out = self.hidden.new_empty(self.shape.num_tokens, self.shape.vocab)
        for rows in self.row_chunks():
            out[rows] = self.logits_rows(rows)
        return out

    def logits_rows(self, rows: slice) -> torch.Tensor:
        return self.hidden[rows] @ self.weight.T

    def row_chunks(self) -> list[slice]:
        T = self.shape.num_tokens
        return [slice(start, min(start + LOGITS_CHUNK_ROWS, T)) for start in range(0, T, LOGITS_CHUNK_ROWS)]


def split_lengths(num_tokens: int, num_seqs: int, generator: torch.Generator) -> list[int]:
    """Lengths >= 1 drawn from 0.5x..1.5x the mean, summing exactly to `num_tokens`."""
    if not 1 <= num_seqs <= num_tokens:
        raise ValueError(f"need 1 <= num_seqs <= num_tokens, got {num_seqs} and {num_tokens}")
    raw = 0.5 + torch.rand(num_seqs, generator=generator, dtype=torch.float64)
    lengths = (raw / raw.sum() * (num_tokens - num_seqs)).floor().long() + 1
    lengths[torch.argmax(lengths)] += num_tokens - int(lengths.sum())
    return lengths.tolist()


def seq_mean_token_mean_weight(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """weight[t] = valid[t] / (n_valid(seq(t)) * S): sum(weight * l) is the seq-mean-token-mean loss."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    per_seq = torch.zeros(lengths.numel(), device=cu.device).index_add_(0, seq_id, loss_mask.float())
    return loss_mask.float() / (per_seq.clamp_min(1.0)[seq_id] * lengths.numel())


@torch.no_grad()
def chunked_target_logprobs(workload: Workload) -> torch.Tensor:
    """fp32 log p(target) without holding a [T, V] fp32 buffer."""
    out = torch.empty(workload.shape.num_tokens, dtype=torch.float32, device=workload.hidden.device)
    for rows in workload.row_chunks():
        z = workload.logits_rows(rows).float()
        out[rows] = z.log_softmax(-1).gather(1, workload.target_ids[rows, None]).squeeze(1)
    return out


def make_workload(shape: Shape, device: str | torch.device, seed: int = 0, mask_frac: float = 0.9) -> Workload:
    g = torch.Generator().manual_seed(seed)
    T, V, H, S = shape.num_tokens, shape.vocab, shape.hidden, shape.num_seqs
    lengths = split_lengths(T, S, g)
    cu = torch.zeros(S + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    loss_mask = torch.rand(T, generator=g) < mask_frac
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    # hidden ~ N(0,1), weight ~ N(0, 2/H): logits have std ~1.4, a realistic softmax spread.
    hidden = torch.randn(T, H, generator=dev_gen, device=device, dtype=torch.float32).to(shape.torch_dtype)
    weight = (torch.randn(V, H, generator=dev_gen, device=device) * (2.0 / H) ** 0.5).to(shape.torch_dtype)
    workload = Workload(
        shape=shape,
        cu_seqlens=cu.to(device),
        lengths=lengths,
        target_ids=torch.randint(0, V, (T,), generator=g).to(device),
        loss_mask=loss_mask.to(device),
        old_logprobs=torch.empty(0),
        advantages=torch.randn(S, generator=g).to(device),
        token_weight=seq_mean_token_mean_weight(cu, loss_mask).to(device),
        hidden=hidden,
        weight=weight,
    )
    noise = 0.1 * torch.randn(T, generator=g).to(device)
    workload.old_logprobs = (chunked_target_logprobs(workload) + noise).clamp_max(0.0)
    return workload


def to_padded(workload: Workload, packed: torch.Tensor, extra_row: bool = False, fill: float = 0.0) -> torch.Tensor:
    """[T, ...] packed rows -> [S, L_max (+1), ...] padded rows (the `+1` is Liger's logits layout)."""
    S, L = len(workload.lengths), max(workload.lengths)
    out = packed.new_full((S, L + int(extra_row), *packed.shape[1:]), fill)
    cu = workload.cu_seqlens.tolist()
    for i in range(S):
        out[i, : workload.lengths[i]] = packed[cu[i] : cu[i + 1]]
    return out


def ppo_clip_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
    """-min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) per token (the objective every case computes)."""
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * advantage, ratio.clamp(1.0 - EPS_LOW, 1.0 + EPS_HIGH) * advantage)


@torch.no_grad()
def reference_loss(workload: Workload) -> float:
    """The objective in float64 from the same (dtype-rounded) logits every logits-level case sees."""
    total = torch.zeros((), dtype=torch.float64, device=workload.hidden.device)
    advantage = torch.repeat_interleave(workload.advantages, torch.tensor(workload.lengths, device=total.device))
    for rows in workload.row_chunks():
        z = workload.logits_rows(rows).double()
        logp = z.log_softmax(-1).gather(1, workload.target_ids[rows, None]).squeeze(1)
        token_loss = ppo_clip_token_loss(logp, workload.old_logprobs[rows].double(), advantage[rows].double())
        total += (token_loss * workload.token_weight[rows].double()).sum()
    return float(total)
