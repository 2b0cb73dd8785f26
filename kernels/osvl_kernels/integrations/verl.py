"""verl (0.9.x) adapter: a registered policy loss, a fatal-aware advantage estimator with the
trainer hook that feeds it, and the fused lm_head + GRPO loss on verl's remove-padding layout.

Nothing here imports verl until `register_verl()` runs, so `osvl_kernels` stays torch + triton.
Wiring and the full configuration: docs/integrations.md; runnable:
examples/verl_grpo.py.

Fatal-aware advantages. verl 0.9.1 hands a registered estimator only token_level_rewards,
response_mask, index (uid) and the algorithm config (per-sample data reaches only its built-in
"gdpo", and the v1 trainer's advantage step reads a fixed field list), so a per-sample fatal flag
cannot reach an estimator through configuration alone. The reward function returns the flag in
its result dict (`{"score": r, "osvl_fatal": True}`: verl keeps it in each sample's
`extra_fields["reward_extra_info"]`); the registered v1 trainer modes "osvl_fatal_<mode>"
(`trainer.v1.trainer_mode=osvl_fatal_sync`, ...) read those flags before verl's advantage step and
hand them to the "osvl_fatal_grpo" estimator, which raises if it gets none.

Semantics follow osvl, not verl, where they differ: a group of one gets advantage 0 (verl: the raw
reward), sequences with no valid token still count in the local sequence normaliser when verl
gives no global_batch_size, and the log-ratio is not clamped to [-20, 20] (it only matters for
|log pi - log pi_old| > 20). Where verl and osvl agree (the dual clip acts only for A < 0; the KL
estimate is clamped at 10; token-sum is scaled by dp_size) the losses and gradients are verl's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

from osvl_kernels.advantages import group_advantages
from osvl_kernels.inputs import plan_grpo_loss
from osvl_kernels.linear_grpo_loss import linear_grpo_loss
from osvl_kernels.loss_config import GRPOLossConfig, LossHyper
from osvl_kernels.objective import token_terms

POLICY_LOSS_NAME = "osvl_fatal_grpo"
ADV_ESTIMATOR_NAME = "osvl_fatal_grpo"
# verl 0.9.1's kl_penalty computes both as the k3 estimator, clamped to [-10, 10] (k3 >= 0, so only
# the upper bound acts, and it zeroes the gradient where it does); "+" (straight-through k2) and
# the other estimators are refused.
VERL_KL_TYPES = ("k3", "low_var_kl")
VERL_KL_MAX = 10.0
# The key a reward function's result dict uses for the fatal flag, and the trainer-mode prefix.
FATAL_KEY = "osvl_fatal"
FATAL_TRAINER_PREFIX = "osvl_fatal_"
_FATAL_FLAGS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("osvl_fatal_flags", default=None)


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
    if loss_agg_mode == "token-sum":
        return {"num_tokens": None, "num_seqs": None, "max_response_len": None}
    scale = info.get("loss_scale_factor") or _cfg(config, "loss_scale_factor", None)
    return {
        "num_tokens": None if num_tokens is None else num_tokens / dp_size,
        "num_seqs": None if num_seqs is None else num_seqs / dp_size,
        "max_response_len": int(scale) if scale else response_len,
    }


def token_sum_scale(config: Any, loss_agg_mode: str) -> float:
    """verl's token-sum is the local token sum times dp_size (DP averaging then gives the global sum)."""
    if loss_agg_mode != "token-sum":
        return 1.0
    return float(dict(_cfg(config, "global_batch_info", {}) or {}).get("dp_size") or 1)


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
    normalizers = global_normalizers(config, loss_agg_mode, R)
    plan = plan_grpo_loss(
        GRPOLossConfig(loss_agg=loss_agg_mode, max_response_len=normalizers["max_response_len"], validate=False),
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
        num_seqs=normalizers["num_seqs"],
        num_tokens=normalizers["num_tokens"],
    )
    logp = log_prob.reshape(-1).float()
    terms = token_terms(logp, plan.token_advantage, old_log_prob.reshape(-1), None, clip_hyper(config))
    per_token = terms.loss if rollout_is_weights is None else terms.loss * rollout_is_weights.reshape(-1).float()
    loss = (plan.weight * per_token).sum() * token_sum_scale(config, loss_agg_mode)
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
    """verl advantage estimator "osvl_fatal_grpo": `group_advantages` broadcast over response tokens,
    fatal samples clamped to A >= 0.

    The flags come from `is_fatal` [B] or, inside verl, from the "osvl_fatal_<mode>" trainer
    (`fatal_flags`); without either this raises rather than silently clamping nothing.
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
    if is_fatal is None:
        is_fatal = _FATAL_FLAGS.get()
    if is_fatal is None:
        raise ValueError(
            f"the {ADV_ESTIMATOR_NAME} estimator got no fatal flags: run verl with "
            f"trainer.v1.trainer_mode={FATAL_TRAINER_PREFIX}<mode> (e.g. {FATAL_TRAINER_PREFIX}sync) and a reward "
            f"function that returns {{'score': ..., '{FATAL_KEY}': bool}}, or pass is_fatal"
        )
    if is_fatal.shape != rewards.shape:
        raise ValueError(f"is_fatal must be [B={rewards.shape[0]}], got {tuple(is_fatal.shape)}")
    groups = group_ids_from_index(index, rewards.device)
    if groups.numel() != rewards.numel():
        raise ValueError(f"index has {groups.numel()} entries for {rewards.numel()} samples")
    with torch.no_grad():
        adv = group_advantages(
            rewards,
            groups,
            is_fatal.to(rewards.device).bool(),
            estimator="grpo" if norm_adv_by_std_in_grpo else "drgrpo",
            eps=epsilon,
        )
        scores = adv[:, None] * response_mask.to(adv.dtype)
    return scores, scores


def responses_to_packed(responses: torch.Tensor, cu_seqlens: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
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
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor loss straight from the final hidden states: lm_head, log-probs, PPO clip, KL and
    entropy in `linear_grpo_loss`, never materialising [T, V] logits.

    Inputs are verl's remove-padding layout: `hidden_states` [T, H] (or [1, T, H]) from the
    backbone, `input_ids_rmpad_rolled` [T], `cu_seqlens` = input_ids.offsets(), `response_lens`
    [B]; `old_log_probs`/`advantages`/`response_mask`/`ref_log_prob`/`rollout_is_weights` are
    verl's padded [B, R] response fields. KL (`use_kl_loss`, k3 clamped at 10 as verl does),
    entropy (`entropy_coeff`), aggregation and `global_batch_info` follow the actor config, and
    rollout_is_weights scale the policy-gradient term, as in verl's `ppo_loss`.
    `verl_fused_ppo_loss` reads all of these from verl's micro-batch.
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
    if rollout_is_weights is not None and rollout_is_weights.shape != response_mask.shape:
        raise ValueError(
            f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} != response_mask {tuple(response_mask.shape)}"
        )
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
        kl_max=VERL_KL_MAX,
        entropy_coef=hyper.entropy_coef,
        temperature=temperature,
        loss_agg=mode,
        **global_normalizers(config, mode, response_mask.shape[1]),
        tp_group=tp_group,
        is_weights=None if rollout_is_weights is None else packed(rollout_is_weights.detach().float()),
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
    scale = token_sum_scale(config, mode)
    return (out.loss * scale if scale != 1.0 else out.loss), metrics


def verl_fused_ppo_loss(
    config: Any, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, data: Any, tp_group: Any = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's `ppo_loss(config, model_output, data)` (verl/workers/utils/losses.py) computed from the
    final hidden states instead of `model_output`'s log-probs: same micro-batch TensorDict (nested
    input_ids / prompts / responses, response fields, dp_size / batch_num_tokens / global_batch_size,
    temperature), same global_batch_info, same loss. The engine's forward has to hand over the
    hidden states and the lm_head weight (see docs/integrations.md: verl's engines compute log-probs inside the
    model forward, so this needs a `forward_step` override)."""
    input_ids = data["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise ValueError("verl_fused_ppo_loss needs verl's no-padding micro-batch (nested input_ids)")
    info = {key: _non_tensor(data, key) for key in ("dp_size", "batch_num_tokens", "global_batch_size")}
    config.global_batch_info.update(info, loss_scale_factor=_cfg(config, "loss_scale_factor", None))
    fields = ["response_mask", "old_log_probs", "advantages"]
    fields += [key for key in ("rollout_is_weights", "ref_log_prob") if key in data.keys()]
    padded = data.select(*fields).to_padded_tensor()
    temperature = _non_tensor(data, "temperature")
    if isinstance(temperature, torch.Tensor):
        if not bool((temperature == temperature.reshape(-1)[0]).all()):
            raise ValueError("the fused loss needs one temperature for the micro-batch (verl: use_fused_kernels too)")
        temperature = float(temperature.reshape(-1)[0])
    return verl_fused_policy_loss(
        hidden_states,
        lm_head_weight,
        torch.roll(input_ids.values(), shifts=-1, dims=0),
        input_ids.offsets(),
        data["responses"].offsets().diff(),
        padded["old_log_probs"],
        padded["advantages"],
        padded["response_mask"],
        config=config,
        temperature=float(temperature),
        ref_log_prob=padded.get("ref_log_prob", None),
        tp_group=tp_group,
        rollout_is_weights=padded.get("rollout_is_weights", None),
    )


def _non_tensor(data: Any, key: str) -> Any:
    value = data[key]
    return getattr(value, "data", value) if not isinstance(value, torch.Tensor) else value


def fatal_flags_from_extra_fields(extra_fields: list[Any], key: str = FATAL_KEY) -> torch.Tensor:
    """[B] bool fatal flags from verl's per-sample `extra_fields` (each a dict whose
    "reward_extra_info" holds what the reward function returned). A sample without the key is
    not fatal; a value that is not a bool (or 0/1) is an error."""
    flags = []
    for i, fields in enumerate(extra_fields):
        info = (fields or {}).get("reward_extra_info", {}) if isinstance(fields, dict) else {}
        value = info.get(key, False) if isinstance(info, dict) else False
        if hasattr(value, "item"):
            value = value.item()
        if value not in (True, False):  # also accepts 0 / 1
            raise ValueError(f"sample {i}: reward_extra_info[{key!r}] must be a bool, got {value!r}")
        flags.append(bool(value))
    return torch.tensor(flags, dtype=torch.bool)


@contextlib.contextmanager
def fatal_flags(flags: torch.Tensor) -> Iterator[None]:
    """The flags the "osvl_fatal_grpo" estimator reads while this context is open (one batch, in
    the order verl hands the estimator its samples)."""
    token = _FATAL_FLAGS.set(flags)
    try:
        yield
    finally:
        _FATAL_FLAGS.reset(token)


def fatal_aware_trainer(base: type, kv_batch_get: Callable[..., Any] | None = None) -> type:
    """A verl v1 trainer class (subclass of `base`, e.g. PPOTrainerSync) whose advantage step
    first reads each sample's fatal flag from the TransferQueue field "extra_fields"."""

    class FatalAwareTrainer(base):
        def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
            get = kv_batch_get
            if get is None:
                import transfer_queue as tq

                get = tq.kv_batch_get
            data = get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
            flags = fatal_flags_from_extra_fields(list(data["extra_fields"]))
            metrics["osvl/fatal_frac"] = flags.float().mean().item() if flags.numel() else 0.0
            with fatal_flags(flags):
                return super()._compute_advantage(batch, metrics)

    FatalAwareTrainer.__name__ = FatalAwareTrainer.__qualname__ = f"OsvlFatal{base.__name__}"
    return FatalAwareTrainer


def register_verl() -> None:
    """Register the policy loss and the advantage estimator in verl's registries (idempotent)."""
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(POLICY_LOSS_NAME)(osvl_policy_loss)
    core_algos.register_adv_est(ADV_ESTIMATOR_NAME)(fatal_grpo_advantage)


def register_verl_trainers() -> list[str]:
    """Register "osvl_fatal_<mode>" for every v1 trainer mode verl has (idempotent); returns the
    names. Needs verl's v1 trainer stack (transfer_queue) importable."""
    from verl.trainer.ppo.v1 import trainer_base

    names = []
    for mode, cls in list(trainer_base.TRAINER_REGISTRY.items()):
        if mode.startswith(FATAL_TRAINER_PREFIX):
            continue
        name = FATAL_TRAINER_PREFIX + mode
        if name not in trainer_base.TRAINER_REGISTRY:
            trainer_base.register_trainer(name)(fatal_aware_trainer(cls))
        names.append(name)
    return names
