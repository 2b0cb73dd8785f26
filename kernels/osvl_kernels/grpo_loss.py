"""`grpo_loss`: fatal-aware GRPO over packed variable-length logits, forward and gradient in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osvl_kernels.autograd import loss_with_grads
from osvl_kernels.inputs import LossPlan, check_logits_inputs, plan_grpo_loss
from osvl_kernels.loss_config import GRPOLossConfig, resolve_loss_config
from osvl_kernels.token_pass import token_pass
from osvl_kernels.token_results import TokenPassResult


@dataclass
class GRPOLossOutput:
    loss: torch.Tensor  # scalar, differentiable
    logprobs: torch.Tensor  # [T] fp32, detached; 0 where the token is not valid
    advantages: torch.Tensor  # [S] fp32 after the clamp (or the caller's advantages)
    metrics: dict[str, torch.Tensor]  # 0-d tensors, never synchronised here


def loss_metrics(
    result: TokenPassResult,
    plan: LossPlan,
    old_logprobs: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    valid = plan.valid
    count = valid.sum()
    denom = count.clamp_min(1).float()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.float(), torch.zeros_like(x, dtype=torch.float32)).sum() / denom

    # The -inf sentinel keeps the max defined for a batch with no tokens at all.
    masked_ratio = torch.where(valid, result.ratio, torch.full_like(result.ratio, float("-inf")))
    ratio_max = torch.cat([masked_ratio, masked_ratio.new_full((1,), float("-inf"))]).max()
    if old_logprobs is None:
        abs_diff = torch.zeros((), device=valid.device)
    else:
        abs_diff = mean((result.logp - old_logprobs.float()).abs())
    if plan.is_weight is None:
        is_weight_mean = (count > 0).float()
        is_capped_frac = torch.zeros((), device=valid.device)
    else:
        is_weight_mean, is_capped_frac = mean(plan.is_weight), mean(plan.is_capped)
    return {
        "clip_frac": mean(result.clipped),
        "dual_clip_frac": mean(result.dual_clipped),
        "ratio_mean": mean(result.ratio),
        "ratio_max": torch.where(count > 0, ratio_max, torch.zeros_like(ratio_max)),
        "kl_mean": mean(result.kl),
        "entropy_mean": mean(result.entropy),
        "num_valid_tokens": count,
        "num_fatal_seqs": plan.is_fatal.sum(),
        "num_clamped_seqs": plan.clamped.sum(),
        "logprob_abs_diff_mean": abs_diff,
        "is_weight_mean": is_weight_mean,  # importance weight of the policy-gradient term (1 without one)
        "is_capped_frac": is_capped_frac,  # share of valid tokens whose weight the correction truncated/masked
    }


def grpo_loss_output(
    result: TokenPassResult,
    plan: LossPlan,
    old_logprobs: torch.Tensor | None,
    inputs: list[torch.Tensor],
    grads: list[torch.Tensor | None],
) -> GRPOLossOutput:
    """The loss every entry point returns: the plan-weighted sum of the per-token objective, whose
    backward hands out the gradients the pass already wrote (grads[i] for inputs[i], None where
    none was asked), plus the per-token log-probs and the metrics."""
    with torch.no_grad():
        loss_value = (plan.weight * result.loss).sum()
    if any(g is not None for g in grads):
        loss = loss_with_grads(loss_value, inputs, grads)
    else:
        loss = loss_value
    return GRPOLossOutput(
        loss=loss,
        logprobs=result.logp,
        advantages=plan.advantages,
        metrics=loss_metrics(result, plan, old_logprobs),
    )


def grpo_loss(
    logits: torch.Tensor,
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
    config: GRPOLossConfig | None = None,
    **settings,
) -> GRPOLossOutput:
    """Fatal-aware GRPO loss over packed logits [T, V]; row t scores target_ids[t].

    The loss's settings are ``config`` with any of its fields given as keywords on top
    (:class:`GRPOLossConfig`: clip range, KL and entropy, advantages, aggregation, backend, validate).
    The gradient w.r.t. `logits` is written during this call (closed form) and handed to autograd;
    with `inplace_grad=True` it overwrites `logits` itself (the logits are consumed), so no second
    [T, V] buffer exists. Importance weights of the policy-gradient term: `is_weights` [T], or
    `behavior_logprobs` [T] (the sampling engine's log-probs) with the config's `rollout_correction`
    (see importance.py). `num_seqs` / `num_tokens`: the aggregation's global normalisers (default:
    this call's). See reference.py for the exact semantics.
    """
    config = resolve_loss_config("grpo_loss", config, settings)
    check_logits_inputs(logits, target_ids)
    plan = plan_grpo_loss(
        config,
        num_tokens_total=logits.shape[0],
        device=logits.device,
        target_ids=target_ids,
        vocab_size=logits.shape[1],
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
    grad = None
    if logits.requires_grad:
        grad = logits.detach() if inplace_grad else torch.empty_like(logits)
    with torch.no_grad():
        result = token_pass(
            logits.detach(),
            target_ids,
            plan.weight,
            plan.token_advantage,
            None if old_logprobs is None else old_logprobs.detach(),
            None if ref_logprobs is None else ref_logprobs.detach(),
            config.hyper,
            grad,
            backend=config.backend,
        )
    return grpo_loss_output(result, plan, old_logprobs, [logits], [grad])
