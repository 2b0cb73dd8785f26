"""Analytic peak memory of the fused-linear GRPO losses: every buffer live at the peak.

The model follows the code (ours: `osvl_kernels/linear_grpo_loss.py`; Liger 0.8.5:
`liger_kernel/chunked_loss/fused_linear_ppo.py`) and counts bytes allocated during one
forward+backward step on top of the inputs, gradients included, i.e. what
`torch.cuda.max_memory_allocated() - memory_allocated()` reports up to allocator rounding.
Vectors of length T (log-probs, per-token weights, metrics) are left out: they are < 1 % here.

Liger, per padded sequence chunk (its default chunk_size=1), runs a custom autograd Function
whose backward recomputes the logits in [2048, 4096] fp32 tiles and builds a fresh fp32 [V, H]
weight gradient, returns it cast to the weight dtype and adds that into a weight-dtype [V, H]
accumulator. Its peak is that cast on the last chunk: accumulator + fp32 dW + cast dW, with
the earlier chunks' input gradients (kept in a list until the final `torch.cat`) alive; at
small V·H its fixed 4096-row fp32 vocab tiles in the recompute loop can peak higher instead.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class Buffer:
    name: str
    nbytes: int


@dataclass(frozen=True)
class Problem:
    num_tokens: int  # T packed tokens
    hidden: int  # H
    vocab: int  # V (this rank's shard)
    num_seqs: int  # S, Liger's padded batch
    padded_len: int  # L, Liger's padded length (longest sequence)
    itemsize: int  # bytes per element of hidden/weight (2 for bf16)

    def __post_init__(self) -> None:
        for name in ("num_tokens", "hidden", "vocab", "num_seqs", "padded_len", "itemsize"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.padded_len * self.num_seqs < self.num_tokens:
            raise ValueError(
                f"padded_len * num_seqs ({self.padded_len * self.num_seqs}) must cover T={self.num_tokens}"
            )


def osvl_peak(p: Problem, chunk_rows: int, on_cpu: bool = False) -> list[Buffer]:
    """Ours with the default dW accumulator (weight dtype), at the last chunk's dW GEMM."""
    buffers = [
        Buffer("grad_weight [V,H] weight dtype (returned as weight.grad)", p.vocab * p.hidden * p.itemsize),
        Buffer("grad_hidden [T,H] input dtype (returned as hidden.grad)", p.num_tokens * p.hidden * p.itemsize),
        Buffer("logits/grad chunk [chunk,V] input dtype", min(chunk_rows, p.num_tokens) * p.vocab * p.itemsize),
    ]
    if on_cpu:  # the torch backend's block buffers: the probabilities, plus a fp32 copy of half-precision logits
        rows = min(chunk_rows, p.num_tokens, torch_backend_rows(p.vocab))
        count = 1 if p.itemsize == FP32 else 2
        buffers.append(
            Buffer(
                f"torch-backend token pass fp32 block buffers, {count} x [rows,V] (CPU only)",
                count * rows * p.vocab * FP32,
            )
        )
    return buffers


def torch_backend_rows(vocab: int) -> int:
    from osvl_kernels.token_pass import chunk_rows

    return chunk_rows(vocab)


def osvl_fp32_accum_peak(p: Problem, chunk_rows: int) -> list[Buffer]:
    """Ours with `grad_weight_accum_dtype=torch.float32`, at the final cast of the accumulator."""
    buffers = [
        Buffer("fp32 grad_weight accumulator [V,H]", p.vocab * p.hidden * FP32),
        Buffer("grad_weight cast [V,H] weight dtype", p.vocab * p.hidden * p.itemsize),
        Buffer("grad_hidden [T,H] input dtype", p.num_tokens * p.hidden * p.itemsize),
    ]
    if p.itemsize == FP32:  # the cast is a no-op; the loop (accumulator + chunk) is the peak
        buffers[1] = Buffer("logits/grad chunk [chunk,V] input dtype", min(chunk_rows, p.num_tokens) * p.vocab * FP32)
    return buffers


def liger_peak(p: Problem) -> list[Buffer]:
    """LigerFusedLinearGRPOLoss(chunk_size=1) on its last sequence: the larger of the recompute
    loop's last vocab tile and the dW cast after it (the cast wins at real shapes; the fixed
    4096-row tile can win when V·H is small)."""
    L, H, V = p.padded_len, p.hidden, p.vocab
    tile = min(4096, V)  # its _SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE
    common = [
        Buffer("grad_weight accumulator [V,H] weight dtype", V * H * p.itemsize),
        Buffer("chunk fp32 grad_weight [V,H]", V * H * FP32),
        Buffer("earlier chunks' grad_input [(S-1),L,H] input dtype", (p.num_seqs - 1) * L * H * p.itemsize),
        Buffer("chunk fp32 grad_hidden [L,H]", L * H * FP32),
    ]
    loop = common + [
        Buffer("fp32 [4096,H] tile: dW tile product (the weight tile's fp32 copy before it)", tile * H * FP32),
        Buffer("fp32 logits/probs/grad tiles 3 x [L,4096] (recompute loop)", 3 * L * tile * FP32),
    ]
    cast = common + [
        Buffer("chunk grad_hidden cast [L,H] input dtype", L * H * p.itemsize if p.itemsize < FP32 else 0),
        Buffer("chunk grad_weight cast [V,H] weight dtype", V * H * p.itemsize if p.itemsize < FP32 else 0),
    ]
    return max(loop, cast, key=total)


def returned_gradients_floor(p: Problem) -> int:
    """No implementation can peak below the gradients it returns: dW [V,H] + dH [T,H]."""
    return (p.vocab + p.num_tokens) * p.hidden * p.itemsize


def total(buffers: list[Buffer]) -> int:
    return sum(b.nbytes for b in buffers)


def table(buffers: list[Buffer]) -> list[dict]:
    return [{"buffer": b.name, "bytes": b.nbytes} for b in buffers]
