"""verl (0.9.x) adapter: a registered policy loss, a fatal-aware advantage estimator, and the
fused lm_head + GRPO loss on verl's remove-padding layout.

Nothing here imports verl until `register_verl()` runs, so `osvl_kernels` stays torch + triton.

Wiring (every Ray worker must register, so use verl's external-module hook)::

    VERL_USE_EXTERNAL_MODULES=osvl_kernels.integrations.verl_plugin
    algorithm.adv_estimator=osvl_fatal_grpo            # group z-score (or Dr.GRPO) + one-sided clamp
    algorithm.norm_adv_by_std_in_grpo=true             # false -> "drgrpo" estimator
    actor_rollout_ref.actor.policy_loss.loss_mode=osvl_fatal_grpo
    actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
    actor_rollout_ref.actor.clip_ratio_c=3.0           # dual clip (osvl applies it only for A < 0)
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean

Fatal masking reaches the policy loss through `response_mask` (tokens at and after the fatal step
are zero). verl's `compute_advantage` passes no per-trajectory flags to estimators, so the clamp
needs `is_fatal`: call `fatal_grpo_advantage(..., is_fatal=...)` from the trainer's advantage step
(without it the estimator is plain group-relative, and says so by clamping nothing).

Semantics follow osvl, not verl, where they differ: a group of one gets advantage 0 (verl: the raw
reward), the dual clip never touches A >= 0 tokens, sequences with no valid token still count in the
local sequence normaliser, and the log-ratio is not clamped to [-20, 20].
"""

from __future__ import annotations

from typing import Any

import torch

from osvl_kernels.advantages import group_advantages
from osvl_kernels.inputs import LossHyper, plan_grpo_loss
from osvl_kernels.linear_grpo_loss import linear_grpo_loss
from osvl_kernels.objective import token_terms

POLICY_LOSS_NAME = "osvl_fatal_grpo"
ADV_ESTIMATOR_NAME = "osvl_fatal_grpo"
VERL_KL_TYPES = ("k3", "low_var_kl")  # both are the k3 estimator (low_var_kl adds a [-10, 10] clamp)


def _cfg(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def clip_hyper(config: Any, *, kl_coef: float = 0.0, entropy_coef: float = 0.0, temperature: float = 1.0) -> LossHyper:
    """osvl clip parameters from a verl actor config (clip_ratio, clip_ratio_low/high, clip_ratio_c)."""
    clip = _cfg(config, "clip_ratio", 0.2)
    return LossHyper(
        eps_low=float(_cfg(config, "clip_ratio_low", clip)),
        eps_high=float(_cfg(config, "clip_ratio_high", clip)),
        dual_clip=float(_cfg(config, "clip_ratio_c", 3.0)),
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        temperature=temperature,
    )


def global_normalizers(config: Any, loss_agg_mode: str, response_len: int) -> dict[str, Any]:
    """verl's `global_batch_info` (global counts, loss later averaged over dp ranks) as osvl's
    per-rank normalisers: num_tokens = batch_num_tokens / dp_size, num_seqs = global_batch_size / dp_size."""
    info = dict(_cfg(config, "global_batch_info", {}) or {})
    dp_size = info.get("dp_size") or 1
    num_tokens, num_seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    if dp_size > 1 and loss_agg_mode == "token-mean" and num_tokens is None:
        raise ValueError("verl global_batch_info needs batch_num_tokens when dp_size > 1")
    if dp_size > 1 and loss_agg_mode.startswith("seq-mean") and num_seqs is None:
        raise ValueError("verl global_batch_info needs global_batch_size when dp_size > 1")
    scale = info.get("loss_scale_factor") or _cfg(config, "loss_scale_factor", None)
    return {
        "num_tokens": None if num_tokens is None else num_tokens / dp_size,
        "num_seqs": None if num_seqs is None else num_seqs / dp_size,
        "max_response_len": int(scale) if scale else response_len,
    }


def osvl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl `PolicyLossFn` on padded [B, R] log-probs with osvl's clip/dual-clip/aggregation rules.

    Registered as "osvl_fatal_grpo"; verl adds its own entropy and KL terms around it.
    """
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [B, R], got {tuple(log_prob.shape)}")
    for name, x in (("old_log_prob", old_log_prob), ("advantages", advantages), ("response_mask", response_mask)):
        if x.shape != log_prob.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != log_prob shape {tuple(log_prob.shape)}")
    if rollout_is_weights is not None and rollout_is_weights.shape != log_prob.shape:
        raise ValueError(f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} != {tuple(log_prob.shape)}")
    B, R = log_prob.shape
    device = log_prob.device
    plan = plan_grpo_loss(
        num_tokens_total=B * R,
        device=device,
        target_ids=torch.zeros(B * R, dtype=torch.long, device=device),
        vocab_size=1,
        cu_seqlens=torch.arange(0, B * R + 1, R, dtype=torch.int32, device=device),
        loss_mask=response_mask.reshape(-1).bool(),
        old_logprobs=old_log_prob.reshape(-1),
        rewards=None,
        group_ids=None,
        fatal_step=None,
        token_step=None,
        advantages=advantages.reshape(-1).float(),
        ref_logprobs=None,
        kl_coef=0.0,
        estimator="grpo",
        std="unbiased",
        adv_eps=1e-6,
        clamp_fatal=True,
        loss_agg=loss_agg_mode,
        **global_normalizers(config, loss_agg_mode, R),
        validate=False,
    )
    logp = log_prob.reshape(-1).float()
    terms = token_terms(logp, plan.token_advantage, old_log_prob.reshape(-1), None, clip_hyper(config))
    per_token = terms.loss if rollout_is_weights is None else terms.loss * rollout_is_weights.reshape(-1).float()
    loss = (plan.weight * per_token).sum()
    valid = plan.valid.float()
    denom = valid.sum().clamp_min(1.0)
    metrics = {
        "actor/pg_clipfrac": (terms.clipped.float() * valid).sum().detach() / denom,
        "actor/ppo_kl": ((old_log_prob.reshape(-1).float() - logp.detach()) * valid).sum() / denom,
        "actor/pg_clipfrac_lower": (terms.dual_clipped.float() * valid).sum().detach() / denom,
    }
    return loss, metrics


def group_ids_from_index(index: Any, device: torch.device) -> torch.Tensor:
    """verl's per-sample prompt uids (np.ndarray of str/int) -> int64 group ids."""
    import numpy as np

    if index is None:
        raise ValueError("the osvl_fatal_grpo estimator needs index (the prompt uid of every sample)")
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)


def fatal_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: Any = None,
    is_fatal: torch.Tensor | None = None,
    **unused: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator "osvl_fatal_grpo": `group_advantages` broadcast over response tokens.

    Returns (advantages, returns), both [B, R] and zero outside `response_mask`, as verl expects.
    """
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must be the same [B, R] shape"
        )
    if norm_adv_by_std_in_grpo is None:
        norm_adv_by_std_in_grpo = bool(_cfg(config, "norm_adv_by_std_in_grpo", True))
    rewards = token_level_rewards.sum(dim=-1).float()
    groups = group_ids_from_index(index, rewards.device)
    if groups.numel() != rewards.numel():
        raise ValueError(f"index has {groups.numel()} entries for {rewards.numel()} samples")
    with torch.no_grad():
        adv = group_advantages(
            rewards,
            groups,
            None if is_fatal is None else is_fatal.to(rewards.device).bool(),
            estimator="grpo" if norm_adv_by_std_in_grpo else "drgrpo",
            eps=epsilon,
        )
        scores = adv[:, None] * response_mask.to(adv.dtype)
    return scores, scores


def responses_to_packed(
    responses: torch.Tensor, cu_seqlens: torch.Tensor, response_lens: torch.Tensor
) -> torch.Tensor:
    """Scatter padded response fields [B, R] onto verl's remove-padding layout [T].

    Inverse of verl's `no_padding_2_padding`: response token j of sequence i is scored by the
    packed row cu_seqlens[i+1] - response_len[i] - 1 + j (the row whose next token it is).
    """
    B, R = responses.shape
    if cu_seqlens.numel() != B + 1 or response_lens.numel() != B:
        raise ValueError(f"cu_seqlens must be [B+1={B + 1}] and response_lens [B={B}]")
    lens = response_lens.to(cu_seqlens.device).long()
    j = torch.arange(R, device=cu_seqlens.device)
    keep = j[None, :] < lens[:, None]
    rows = (cu_seqlens[1:].long() - lens - 1)[:, None] + j[None, :]
    out = responses.new_zeros(int(cu_seqlens[-1]))
    out[rows[keep]] = responses.to(cu_seqlens.device)[keep]
    return out


def verl_fused_policy_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids_rmpad_rolled: torch.Tensor,
    cu_seqlens: torch.Tensor,
    response_lens: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    loss_agg_mode: str | None = None,
    temperature: float = 1.0,
    ref_log_prob: torch.Tensor | None = None,
    tp_group: Any = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor loss straight from the final hidden states: lm_head, log-probs, PPO clip, KL and
    entropy in `linear_grpo_loss`, never materialising [T, V] logits.

    Inputs are verl's remove-padding layout: `hidden_states` [T, H] (or [1, T, H]) from the
    backbone, `input_ids_rmpad_rolled` [T], `cu_seqlens` = input_ids.offsets(), `response_lens`
    [B]; `old_log_probs`/`advantages`/`response_mask`/`ref_log_prob` are verl's padded [B, R]
    response fields. KL (`use_kl_loss`, k3) and entropy (`entropy_coeff`) follow the actor config.
    """
    if hidden_states.dim() == 3:
        if hidden_states.shape[0] != 1:
            raise ValueError(f"hidden_states must be [T, H] or [1, T, H], got {tuple(hidden_states.shape)}")
        hidden_states = hidden_states.squeeze(0)
    labels = input_ids_rmpad_rolled.reshape(-1)
    use_kl = bool(_cfg(config, "use_kl_loss", False))
    if use_kl:
        kl_type = _cfg(config, "kl_loss_type", "low_var_kl")
        if kl_type not in VERL_KL_TYPES:
            raise ValueError(f"fused osvl loss supports kl_loss_type in {VERL_KL_TYPES}, got {kl_type!r}")
        if ref_log_prob is None:
            raise ValueError("use_kl_loss=True needs ref_log_prob")
    mode = loss_agg_mode or _cfg(config, "loss_agg_mode", "token-mean")
    hyper = clip_hyper(
        config,
        kl_coef=float(_cfg(config, "kl_loss_coef", 0.0)) if use_kl else 0.0,
        entropy_coef=float(_cfg(config, "entropy_coeff", 0.0)),
        temperature=temperature,
    )

    def packed(x: torch.Tensor) -> torch.Tensor:
        return responses_to_packed(x, cu_seqlens, response_lens)

    loss_mask = packed(response_mask.bool())
    old = packed(old_log_probs.float())
    out = linear_grpo_loss(
        hidden_states,
        lm_head_weight,
        labels,
        cu_seqlens.to(torch.int32),
        loss_mask,
        old_logprobs=old,
        advantages=packed(advantages.float()),
        ref_logprobs=packed(ref_log_prob.float()) if use_kl else None,
        eps_low=hyper.eps_low,
        eps_high=hyper.eps_high,
        dual_clip=hyper.dual_clip,
        kl_coef=hyper.kl_coef,
        entropy_coef=hyper.entropy_coef,
        temperature=temperature,
        loss_agg=mode,
        **global_normalizers(config, mode, response_mask.shape[1]),
        tp_group=tp_group,
    )
    m = out.metrics
    valid = loss_mask.float()
    metrics = {
        "actor/pg_clipfrac": m["clip_frac"],
        "actor/pg_clipfrac_lower": m["dual_clip_frac"],
        "actor/ppo_kl": ((old - out.logprobs) * valid).sum() / valid.sum().clamp_min(1.0),
        "actor/entropy": m["entropy_mean"],
        "actor/kl_loss": m["kl_mean"],
    }
    return out.loss, metrics


def register_verl() -> None:
    """Register the policy loss and the advantage estimator in verl's registries (idempotent)."""
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(POLICY_LOSS_NAME)(osvl_policy_loss)
    core_algos.register_adv_est(ADV_ESTIMATOR_NAME)(fatal_grpo_advantage)
