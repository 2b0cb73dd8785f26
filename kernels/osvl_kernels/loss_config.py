"""The loss's settings, held once: every scalar of the fatal-aware GRPO loss and the backend choice.

`grpo_loss`, `linear_grpo_loss` and `reference_grpo_loss` take a `GRPOLossConfig` (``config=``) and
accept its fields as keywords on top of it, so a trainer builds the config once from its own settings
and a one-off call still reads ``grpo_loss(..., eps_high=0.28)``. The fields are written here only:
the entry points' signatures name the tensors, and `resolve_loss_config` turns the keywords into a
config, refusing a name that is not a field with the nearest one.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from typing import Any

from osvl_kernels.advantages import check_advantage_args
from osvl_kernels.importance import RolloutCorrection

LOSS_AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm", "token-sum")
BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class LossHyper:
    """The per-token objective's scalars (identical on every backend and rank): what a token pass sees.

    kl_max: the k3 estimate is clamped to <= kl_max (no gradient where it is), as verl clamps
    its k3 / low_var_kl at 10. kl_is_weighted: the KL term is multiplied by the ratio
    pi/pi_old (DeepSeek-V3.2's importance-sampling-corrected KL; TRL's use_bias_correction_kl).
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    kl_max: float | None = None
    kl_is_weighted: bool = False

    def __post_init__(self) -> None:
        if not (0.0 <= self.eps_low < 1.0):
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"{name} must be finite, got {value}")
        if self.kl_max is not None and not (0.0 < self.kl_max < float("inf")):
            raise ValueError(f"kl_max must be a finite number > 0 (or None), got {self.kl_max}")


@dataclass(frozen=True)
class GRPOLossConfig(LossHyper):
    """Everything about the loss that is not a tensor, checked once when built.

    estimator / std / adv_eps / clamp_fatal: how advantages are formed when the call passes rewards and
    group ids (with precomputed advantages they do nothing). loss_agg: how token terms are summed
    (``seq-mean-token-sum-norm`` divides by ``max_response_len``). rollout_correction: how the
    engine's log-probs weigh each token (importance.py), used with ``behavior_logprobs``.
    backend: "triton", "torch", or "auto" (Triton on CUDA and under TRITON_INTERPRET=1, else torch).
    validate: run the value checks that need one host transfer (a packer that checked them says False).
    """

    estimator: str = "grpo"
    std: str = "unbiased"
    adv_eps: float = 1e-6
    clamp_fatal: bool = True
    loss_agg: str = "seq-mean-token-mean"
    max_response_len: int | None = None
    rollout_correction: RolloutCorrection | None = None
    backend: str = "auto"
    validate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_advantage_args(self.estimator, self.std, self.adv_eps)
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"unknown loss_agg {self.loss_agg!r}; expected one of {LOSS_AGGREGATIONS}")
        if self.loss_agg == "seq-mean-token-sum-norm" and (self.max_response_len is None or self.max_response_len <= 0):
            raise ValueError("loss_agg='seq-mean-token-sum-norm' needs max_response_len > 0")
        if self.rollout_correction is not None and not isinstance(self.rollout_correction, RolloutCorrection):
            raise ValueError(
                f"rollout_correction must be a RolloutCorrection, got {type(self.rollout_correction).__name__}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")

    @property
    def hyper(self) -> LossHyper:
        return LossHyper(**{f.name: getattr(self, f.name) for f in fields(LossHyper)})


SETTINGS = tuple(f.name for f in fields(GRPOLossConfig))


def resolve_loss_config(function: str, config: GRPOLossConfig | None, settings: dict[str, Any]) -> GRPOLossConfig:
    """``config`` (or the defaults) with the call's keyword ``settings`` on top; a keyword that is not a
    setting is a TypeError naming the function and the nearest setting."""
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], SETTINGS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else f"; the settings are {', '.join(SETTINGS)}"
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}{hint}")
    if config is not None and not isinstance(config, GRPOLossConfig):
        raise TypeError(f"{function}(): config must be a GRPOLossConfig, got {type(config).__name__}")
    base = GRPOLossConfig() if config is None else config
    return replace(base, **settings) if settings else base
