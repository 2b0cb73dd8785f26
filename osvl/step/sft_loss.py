"""SFT loss (paper Eq. 8): cross-entropy over policy tokens, computed from hidden states in row
chunks so no ``[tokens, vocab]`` fp32 buffer ever exists; the backward recomputes each chunk's
logits instead of saving them (the same trade ``linear_grpo_loss`` makes)."""

from __future__ import annotations

import torch


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            logits = hidden[sl].float() @ weight.float().t()
            nll = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[sl, None]).squeeze(1)
            total += nll.sum()
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets = ctx.saved_tensors
        w = weight.float()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(w)
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            h = hidden[sl].float()
            g = torch.softmax(h @ w.t(), dim=-1)
            g.scatter_add_(1, targets[sl, None], -torch.ones_like(g[:, :1]))
            g *= grad_out
            grad_hidden[sl] = (g @ w).to(hidden.dtype)
            grad_weight += g.t() @ h
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def sft_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: int | torch.Tensor,
    chunk: int = 4096,
) -> torch.Tensor:
    """Sum of -log p(target) over ``loss_mask`` rows, divided by ``normalizer`` (global valid tokens).

    hidden [T, D] (any float dtype), weight [V, D] (the lm_head), target_ids [T], loss_mask [T] bool.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [T, D] and weight [V, D] must share D, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if target_ids.shape != hidden.shape[:1] or loss_mask.shape != hidden.shape[:1]:
        raise ValueError(
            f"target_ids and loss_mask must be [{hidden.shape[0]}], got "
            f"{tuple(target_ids.shape)} and {tuple(loss_mask.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    # Only loss rows reach the vocabulary GEMMs: tool observations and prompts (most of a
    # multi-turn trajectory) would otherwise pay V x D FLOPs each for a zero weight.
    keep = loss_mask.nonzero().squeeze(1)
    total = _ChunkedLinearCE.apply(hidden.index_select(0, keep), weight, target_ids[keep].long(), chunk)
    return total / normalizer
