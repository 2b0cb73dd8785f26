"""Per-token importance weights on the policy-gradient term: engine/trainer mismatch correction.

The policy that sampled a rollout (an inference engine: vLLM, SGLang) and the trainer's copy of
the same weights give slightly different log-probs. The PPO ratio is taken against the trainer's
old log-probs, so the samples are off-policy by w = pi_old_trainer / pi_engine; the truncated
importance-sampling correction (TIS) multiplies each token's policy-gradient term by min(w, C).

Two ways in, both resolved once per batch in `plan_grpo_loss` (inputs.py):
* `is_weights` [T]: weights the caller computed (TRL's `importance_sampling_ratio`, verl's
  `rollout_is_weights`), taken as given (detached, finite, >= 0);
* `behavior_logprobs` [T] + a `RolloutCorrection`: the weights computed here from
  old_logprobs - behavior_logprobs over the valid tokens (after the loss mask and the fatal cut).

The weight scales the clipped surrogate only: the KL and entropy terms are not importance
weighted (as in TRL and verl). Since w >= 0, w * max(-r A, -clip(r) A) = max(-r wA, -clip(r) wA)
(and likewise under the dual clip), so the weight is folded into each token's advantage and the
fused kernels run unchanged. (A token whose weight is 0 then counts as unclipped in `clip_frac`.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


@dataclass(frozen=True)
class RolloutCorrection:
    """How to turn behaviour log-probs into importance weights.

    level: "token" (w_t = exp(old_t - behavior_t)) or "sequence" (one w per sequence: exp of the
      sum of old - behavior over its valid tokens, the likelihood ratio of the whole sample).
    mode: "truncate" (w clamped to [low, high]: TIS, C = high) or "mask" (w set to 0 outside
      [low, high], so those tokens drop out of the policy gradient: MIS).
    A token whose behaviour log-prob is NaN (not reported by the engine) counts as on-policy
    (log-ratio 0), as in TRL.
    """

    level: str = "token"
    mode: str = "truncate"
    high: float = 2.0
    low: float | None = None

    def __post_init__(self) -> None:
        if self.level not in IS_LEVELS:
            raise ValueError(f"rollout_correction.level must be one of {IS_LEVELS}, got {self.level!r}")
        if self.mode not in IS_MODES:
            raise ValueError(f"rollout_correction.mode must be one of {IS_MODES}, got {self.mode!r}")
        if not (isinstance(self.high, (int, float)) and 0.0 < self.high < math.inf):
            raise ValueError(f"rollout_correction.high must be a finite number > 0, got {self.high!r}")
        if self.low is not None and not (isinstance(self.low, (int, float)) and 0.0 <= self.low <= self.high):
            raise ValueError(f"rollout_correction.low must be None or in [0, high={self.high}], got {self.low!r}")


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    valid: torch.Tensor,
    seq_id: torch.Tensor,
    num_seqs: int,
    correction: RolloutCorrection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T] fp32, capped [T] bool): each valid token's weight and whether the truncation
    or the mask changed it; invalid tokens get weight 1 and are never capped. No host sync."""
    log_ratio = torch.nan_to_num(old_logprobs.detach().float() - behavior_logprobs.detach().float(), nan=0.0)
    log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    if correction.level == "sequence":
        per_seq = torch.zeros(num_seqs, dtype=torch.float32, device=log_ratio.device).index_add_(0, seq_id, log_ratio)
        log_ratio = per_seq[seq_id]
    ratio = torch.exp(log_ratio)
    low = 0.0 if correction.low is None else correction.low
    outside = (ratio > correction.high) | (ratio < low)
    if correction.mode == "truncate":
        weights = ratio.clamp(min=low, max=correction.high)
    else:
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    capped = outside & valid
    return torch.where(valid, weights, torch.ones_like(weights)), capped
