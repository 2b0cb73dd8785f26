"""MoE router losses as Megatron-Core defines them (the definitions the paper's coefficients are for:
``moe_aux_loss_coeff`` 0.01 and ``moe_z_loss_coeff`` 1e-3 are Megatron-Core settings of its actor).

Load balance (Switch Transformer, Megatron's ``switch_load_balancing_loss_func``), per MoE layer and
per micro-batch of ``n`` tokens routed to ``k`` of ``E`` experts::

    balance = E / (k * n^2) * sum_e P_e * c_e      P_e: sum of the router probabilities of expert e
                                                    c_e: tokens that chose expert e (no gradient)

It is 1.0 under perfectly uniform routing whatever ``E`` and ``k``. Hugging Face's
``load_balancing_loss_func`` (Qwen3-MoE, Qwen3-VL-MoE) is the same sum without the ``1/k``, pooled over
all layers before the product: for one layer it equals ``k * balance``, so its ``router_aux_loss_coef``
(0.001 in the Qwen3-VL-30B-A3B config) is not on the same scale as the coefficient here.

Router z-loss (ST-MoE): the mean over tokens of ``logsumexp(router logits)^2``.

Megatron adds each MoE layer's terms to the objective (a sum over layers) by attaching them to the
router output (``AuxLossInjector``): the gradient enters inside that layer's backward, so it follows
the activation path through activation checkpointing and FSDP's per-layer hooks.
"""

from __future__ import annotations

import torch


def balance_loss(prob_sums: torch.Tensor, counts: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """``E / (k n^2) * sum_e P_e c_e`` of one layer's micro-batch; ``prob_sums`` [E] carries the gradient."""
    num_experts = prob_sums.shape[-1]
    if counts.shape != prob_sums.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and prob_sums {tuple(prob_sums.shape)} must match")
    if num_tokens < 1 or top_k < 1:
        raise ValueError(f"num_tokens and top_k must be >= 1, got {num_tokens} and {top_k}")
    return (prob_sums * counts.to(prob_sums.dtype)).sum() * (num_experts / (top_k * num_tokens * num_tokens))


def z_loss_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over the tokens in ``mask`` of ``logsumexp(logits)^2`` (``logits`` [..., E], ``mask`` [...])."""
    return (torch.logsumexp(logits, dim=-1).square() * mask.to(logits.dtype)).sum()


def expert_counts(expert_ids: torch.Tensor, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert ([E] float32) over the tokens in ``mask``; ``expert_ids`` [..., k]. No host sync."""
    weights = mask.to(torch.float32).unsqueeze(-1).expand(expert_ids.shape).reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=expert_ids.device)
    return counts.index_add_(0, expert_ids.reshape(-1), weights)


def load_cv(counts: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation (population std / mean) of the expert loads, per row of ``counts`` [..., E]."""
    mean = counts.mean(dim=-1)
    return counts.std(dim=-1, correction=0) / mean.clamp_min(1e-12)


class AuxLossInjector(torch.autograd.Function):
    """Returns ``activation`` unchanged; the backward adds ``d loss / d loss = 1`` for ``loss``.

    A loss attached this way joins the objective without the caller ever adding it to the main loss:
    its gradient starts when the activation's gradient arrives (Megatron's ``MoEAuxLossAutoScaler``,
    here with the scale folded into ``loss`` by the caller).
    """

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_activation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad_activation, torch.ones_like(loss)
