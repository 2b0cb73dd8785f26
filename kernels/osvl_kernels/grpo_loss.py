"""`grpo_loss`: fatal-aware GRPO over packed variable-length logits, forward and gradient in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osvl_kernels.autograd import loss_with_grads
from osvl_kernels.importance import RolloutCorrection
from osvl_kernels.inputs import LossHyper, LossPlan, check_logits_inputs, plan_grpo_loss
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
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    estimator: str = "grpo",
    std: str = "unbiased",
    adv_eps: float = 1e-6,
    clamp_fatal: bool = True,
    loss_agg: str = "seq-mean-token-mean",
    num_seqs: int | torch.Tensor | None = None,
    num_tokens: int | torch.Tensor | None = None,
    max_response_len: int | None = None,
    inplace_grad: bool = False,
    backend: str = "auto",
    validate: bool = True,
    kl_max: float | None = None,
    kl_is_weighted: bool = False,
    is_weights: torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    rollout_correction: RolloutCorrection | None = None,
) -> GRPOLossOutput:
    """Fatal-aware GRPO loss over packed logits [T, V]; row t scores target_ids[t].

    The gradient w.r.t. `logits` is written during this call (closed form) and handed to autograd;
    with `inplace_grad=True` it overwrites `logits` itself (the logits are consumed), so no second
    [T, V] buffer exists. `validate=False` skips the value checks that need a host sync.
    `kl_max` / `kl_is_weighted` shape the KL term (see LossHyper). Importance weights of the
    policy-gradient term: `is_weights` [T], or `behavior_logprobs` [T] (the sampling engine's
    log-probs) with a `rollout_correction` (see importance.py).
    See reference.py for the exact semantics.
    """
    check_logits_inputs(logits, target_ids)
    hyper = LossHyper(eps_low, eps_high, dual_clip, kl_coef, entropy_coef, temperature, kl_max, kl_is_weighted)
    plan = plan_grpo_loss(
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
        kl_coef=kl_coef,
        estimator=estimator,
        std=std,
        adv_eps=adv_eps,
        clamp_fatal=clamp_fatal,
        loss_agg=loss_agg,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        max_response_len=max_response_len,
        validate=validate,
        is_weights=is_weights,
        behavior_logprobs=behavior_logprobs,
        rollout_correction=rollout_correction,
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
            hyper,
            grad,
            backend=backend,
        )
    return grpo_loss_output(result, plan, old_logprobs, [logits], [grad])
