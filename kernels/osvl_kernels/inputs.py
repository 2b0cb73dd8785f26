"""Validation of packed GRPO inputs and the per-token plan every backend consumes.

The GRPO semantics that are not per-vocab work (which tokens are valid, each token's advantage,
the aggregation weight of each token) are resolved here once, on [T]- and [S]-sized tensors, so
the heavy backends (Triton, chunked torch, fused-linear, vocab-parallel) only see a weighted
clipped policy-gradient objective per token and cannot disagree on semantics.

Shape and dtype checks never synchronise with the device. Value checks (cu_seqlens covers T,
targets in range, step indices) need the values on the host: they run when `validate=True`,
in a single device-to-host transfer; a trainer whose packer already checked them passes False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osvl_kernels.advantages import group_scores
from osvl_kernels.importance import RolloutCorrection, rollout_is_weights
from osvl_kernels.loss_config import GRPOLossConfig

# Dtypes the entry points accept for logits / hidden states (fp64 for reference-precision tests).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class LossPlan:
    """Per-token and per-sequence tensors resolved from the packed inputs."""

    valid: torch.Tensor  # [T] bool: loss_mask and before the fatal step
    weight: torch.Tensor  # [T] fp32: aggregation weight of each token, 0 where not valid
    token_advantage: torch.Tensor  # [T] fp32, times the importance weight when there is one
    advantages: torch.Tensor  # [S] fp32 (or [T] when the caller passed token advantages)
    is_fatal: torch.Tensor  # [S] bool
    clamped: torch.Tensor  # [S] bool: fatal with a negative pre-clamp advantage (set to 0)
    is_weight: torch.Tensor | None = None  # [T] fp32 importance weight of the policy-gradient term (1 if invalid)
    is_capped: torch.Tensor | None = None  # [T] bool: a rollout correction truncated or masked the weight


def _check_1d(name: str, x: torch.Tensor | None, length: int, kinds: str, device: torch.device) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1 or x.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got {tuple(x.shape)}")
    ok = {
        "float": x.is_floating_point(),
        "int": not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool,
        "bool": x.dtype == torch.bool,
    }[kinds]
    if not ok:
        raise ValueError(f"{name} must be a {kinds} tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device}")


def _check_2d(name: str, x: torch.Tensor, shape: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 2-D {shape} tensor, got {got}")


def check_logits_inputs(logits: torch.Tensor, target_ids: torch.Tensor) -> None:
    """Shape/dtype checks shared by the logits-level entry points."""
    _check_2d("logits", logits, "[T, V]")
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits must be fp32/bf16/fp16, got {logits.dtype}")
    _check_1d("target_ids", target_ids, logits.shape[0], "int", logits.device)


def check_linear_inputs(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor) -> None:
    """Shape/dtype/device checks shared by the hidden-state (lm_head-fused) entry points."""
    _check_2d("hidden", hidden, "[T, H]")
    _check_2d("weight", weight, "[V, H]")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden must be fp32/bf16/fp16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device}, hidden on {hidden.device}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden is [T, {hidden.shape[1]}], weight is [V, {weight.shape[1]}]")
    if weight.shape[0] == 0:
        raise ValueError("weight has no vocab rows")
    _check_1d("target_ids", target_ids, hidden.shape[0], "int", hidden.device)


def plan_grpo_loss(
    config: GRPOLossConfig,
    *,
    num_tokens_total: int,
    device: torch.device,
    target_ids: torch.Tensor,
    vocab_size: int,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    rewards: torch.Tensor | None,
    group_ids: torch.Tensor | None,
    fatal_step: torch.Tensor | None,
    token_step: torch.Tensor | None,
    advantages: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    num_seqs: int | torch.Tensor | None,
    num_tokens: int | torch.Tensor | None,
    is_weights: torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
) -> LossPlan:
    """Checks every input (raising ValueError before any work) and resolves the per-token plan.

    Importance weights (importance.py) come either as `is_weights` [T] or from
    `behavior_logprobs` [T] with a `rollout_correction`; they multiply each token's advantage."""
    T = num_tokens_total
    loss_agg, rollout_correction = config.loss_agg, config.rollout_correction
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [S+1] with S >= 1")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, expected {device}")
    S = cu_seqlens.numel() - 1
    _check_1d("loss_mask", loss_mask, T, "bool", device)
    _check_1d("old_logprobs", old_logprobs, T, "float", device)
    _check_1d("ref_logprobs", ref_logprobs, T, "float", device)
    _check_1d("token_step", token_step, T, "int", device)
    _check_1d("fatal_step", fatal_step, S, "int", device)
    if fatal_step is not None and token_step is None:
        raise ValueError("fatal_step needs token_step (the step index of every token)")
    if config.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    _check_importance_inputs(T, device, old_logprobs, is_weights, behavior_logprobs, rollout_correction)
    if advantages is not None:
        if rewards is not None or group_ids is not None:
            raise ValueError("pass either advantages or rewards + group_ids, not both")
        if advantages.dim() != 1 or advantages.shape[0] not in (S, T):
            raise ValueError(f"advantages must have shape [S={S}] or [T={T}], got {tuple(advantages.shape)}")
        _check_1d("advantages", advantages, advantages.shape[0], "float", device)
    else:
        if rewards is None or group_ids is None:
            raise ValueError("pass rewards and group_ids (or precomputed advantages)")
        _check_1d("rewards", rewards, S, "float", device)
        _check_1d("group_ids", group_ids, S, "int", device)
    for name, value in (("num_seqs", num_seqs), ("num_tokens", num_tokens)):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if config.validate:
        _check_values(T, vocab_size, cu_seqlens, target_ids, loss_mask, fatal_step, token_step, rewards, is_weights)

    # --- resolve the plan (device-side, no synchronisation) ---
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(S, device=device), lengths, output_size=T)
    valid = loss_mask.clone()
    if fatal_step is None:
        is_fatal = torch.zeros(S, dtype=torch.bool, device=device)
    else:
        is_fatal = fatal_step >= 0
        token_fatal = fatal_step.long()[seq_id]
        valid &= (token_fatal < 0) | (token_step.long() < token_fatal)

    if advantages is not None:
        adv = advantages.detach().float()
        per_token = adv.shape[0] == T and T != S
        token_advantage = adv if per_token else adv[seq_id]
        clamped = torch.zeros(S, dtype=torch.bool, device=device)
    else:
        scores = group_scores(rewards, group_ids, estimator=config.estimator, std=config.std, eps=config.adv_eps)
        clamped = is_fatal & (scores < 0) if config.clamp_fatal else torch.zeros_like(is_fatal)
        adv = torch.where(clamped, torch.zeros_like(scores), scores)
        token_advantage = adv[seq_id]

    is_weight = is_capped = None
    if is_weights is not None:
        is_weight = torch.where(valid, is_weights.detach().float(), torch.ones_like(is_weights, dtype=torch.float32))
        is_capped = torch.zeros_like(valid)
    elif behavior_logprobs is not None:
        is_weight, is_capped = rollout_is_weights(old_logprobs, behavior_logprobs, valid, seq_id, S, rollout_correction)
    if is_weight is not None:
        token_advantage = token_advantage * is_weight

    per_seq_valid = torch.zeros(S, dtype=torch.float32, device=device).index_add_(0, seq_id, valid.float())
    num_seqs_f = float(S) if num_seqs is None else num_seqs
    if loss_agg == "token-mean":
        denom = valid.sum().clamp_min(1).float() if num_tokens is None else num_tokens
        weight = valid.float() / denom
    elif loss_agg == "seq-mean-token-sum":
        weight = valid.float() / num_seqs_f
    elif loss_agg == "token-sum":
        weight = valid.float()
    elif loss_agg == "seq-mean-token-mean":
        weight = valid.float() / (per_seq_valid.clamp_min(1.0)[seq_id] * num_seqs_f)
    else:
        weight = valid.float() / (num_seqs_f * float(config.max_response_len))
    return LossPlan(
        valid=valid,
        weight=weight.float(),
        token_advantage=token_advantage.float(),
        advantages=adv,
        is_fatal=is_fatal,
        clamped=clamped,
        is_weight=is_weight,
        is_capped=is_capped,
    )


def _check_importance_inputs(
    T: int,
    device: torch.device,
    old_logprobs: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    behavior_logprobs: torch.Tensor | None,
    rollout_correction: RolloutCorrection | None,
) -> None:
    _check_1d("is_weights", is_weights, T, "float", device)
    _check_1d("behavior_logprobs", behavior_logprobs, T, "float", device)
    if is_weights is not None and behavior_logprobs is not None:
        raise ValueError("pass either is_weights or behavior_logprobs + rollout_correction, not both")
    if (behavior_logprobs is None) != (rollout_correction is None):
        raise ValueError("behavior_logprobs and rollout_correction go together (one was given without the other)")
    if behavior_logprobs is not None and old_logprobs is None:
        raise ValueError("behavior_logprobs needs old_logprobs (the weight is exp(old_logprobs - behavior_logprobs))")


def _check_values(
    T: int,
    V: int,
    cu_seqlens: torch.Tensor,
    target_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    fatal_step: torch.Tensor | None,
    token_step: torch.Tensor | None,
    rewards: torch.Tensor | None,
    is_weights: torch.Tensor | None = None,
) -> None:
    """Value checks gathered into one host transfer."""
    cu = cu_seqlens.long()
    checks = [
        cu[0] == 0,
        cu[-1] == T,
        (cu[1:] >= cu[:-1]).all(),
        ((target_ids >= 0) & (target_ids < V) | ~loss_mask).all(),
        torch.ones((), dtype=torch.bool, device=cu.device) if fatal_step is None else (fatal_step >= -1).all(),
        torch.ones((), dtype=torch.bool, device=cu.device) if token_step is None else (token_step >= 0).all(),
        torch.ones((), dtype=torch.bool, device=cu.device) if rewards is None else torch.isfinite(rewards).all(),
        torch.ones((), dtype=torch.bool, device=cu.device)
        if is_weights is None
        else (torch.isfinite(is_weights) & (is_weights >= 0) | ~loss_mask).all(),
    ]
    ok = torch.stack([c.reshape(()) for c in checks]).tolist()
    messages = [
        "cu_seqlens must start at 0",
        f"cu_seqlens must end at T={T} (it must cover every token exactly once)",
        "cu_seqlens must be non-decreasing",
        f"target_ids of loss tokens must be in [0, {V})",
        "fatal_step must be -1 (non-fatal) or a step index >= 0",
        "token_step must be >= 0",
        "rewards must be finite",
        "is_weights of loss tokens must be finite and >= 0",
    ]
    for good, message in zip(ok, messages):
        if not good:
            raise ValueError(message)
