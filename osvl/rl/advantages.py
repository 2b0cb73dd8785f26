"""Per-sequence advantages for a scored batch under the paper's RL ablation modes (Table 3b).

==============  =========================================================================
mode            what happens to a fatal trajectory
==============  =========================================================================
``vanilla``     nothing: trained on in full with its plain group advantage
``hard_mask``   dropped whole from the loss (Vision-DeepResearch)
``fatal_mask``  tokens from the fatal step on are masked; advantage not clamped
``fatal_clamp`` masked as above and advantage clamped at zero (default; the paper's method)
==============  =========================================================================

In every mode the group statistics use every *scored* trajectory of the group, fatal ones
included (paper App. B.2, and the hard-mask comparison of App. B Step 4, where non-fatal
advantages are identical under both schemes). Unscored samples (a judge could not answer) and
rollouts hit by infra errors are not passed to the statistics at all; they get advantage 0, are
dropped from the loss, and are counted. The arithmetic itself is ``osvl_kernels.group_advantages``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from osvl.rl.fatal import NOT_FATAL
from osvl.rl.rewards import INFRA_UNSCORED
from osvl.rl.trajectory import Trajectory
from osvl_kernels import group_advantages
from osvl_kernels.advantages import check_advantage_args

FatalMode = Literal["vanilla", "hard_mask", "fatal_mask", "fatal_clamp"]
MODES: tuple[str, ...] = ("vanilla", "hard_mask", "fatal_mask", "fatal_clamp")

DROP_UNSCORED = "unscored"
DROP_INFRA = "infra_error"
DROP_HARD_MASKED = "hard_masked"


@dataclass(frozen=True)
class AdvantageConfig:
    """Fatal handling mode and group estimator (the paper's Table 5 uses ``rloo``)."""

    mode: FatalMode = "fatal_clamp"
    estimator: str = "grpo"  # grpo | rloo | drgrpo
    std: str = "unbiased"  # unbiased | population (grpo only)
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown fatal mode {self.mode!r}; expected one of: {', '.join(MODES)}")
        check_advantage_args(self.estimator, self.std, self.eps)


@dataclass(frozen=True)
class AdvantageBatch:
    """Everything the loss needs per sequence, plus what the statistics need to explain it."""

    advantages: torch.Tensor  # [N] fp32; 0 where the sequence is dropped
    pre_clamp: torch.Tensor  # [N] fp32 group-relative score before any clamp; 0 where unscored
    loss_fatal_steps: torch.Tensor  # [N] int64 first masked step for the loss; -1 masks nothing
    is_fatal: torch.Tensor  # [N] bool, by the fatal rule, whatever the mode
    in_statistics: torch.Tensor  # [N] bool: scored, counted in its group's mean/std
    keep: torch.Tensor  # [N] bool: enters the loss
    drop_reasons: tuple[str | None, ...]  # None, "unscored", "infra_error" or "hard_masked"
    mode: FatalMode


def compute_advantages(
    rewards: Sequence[float | None],
    group_ids: Sequence[int],
    fatal_steps: Sequence[int],
    config: AdvantageConfig = AdvantageConfig(),
    exclusions: Sequence[str | None] | None = None,
) -> AdvantageBatch:
    """Advantages for N sequences; ``rewards[i] is None`` (or an exclusion reason) leaves ``i`` out.

    ``fatal_steps`` follow :func:`osvl.rl.fatal.find_fatal_step` (-1 = non-fatal,
    ``len(steps)`` = fatal at the end). ``exclusions[i]`` names why sample ``i`` is not scored
    (``"infra_error"``, ``"unscored"``); when omitted, a None reward means ``"unscored"``.
    """
    n = len(rewards)
    if len(group_ids) != n or len(fatal_steps) != n:
        raise ValueError(
            f"rewards ({n}), group_ids ({len(group_ids)}) and fatal_steps "
            f"({len(fatal_steps)}) must have the same length"
        )
    if exclusions is None:
        exclusions = [None] * n
    elif len(exclusions) != n:
        raise ValueError(f"exclusions ({len(exclusions)}) must have length {n}")
    reasons: list[str | None] = [
        reason if reason is not None else (DROP_UNSCORED if reward is None else None)
        for reward, reason in zip(rewards, exclusions)
    ]

    fatal = torch.tensor([step != NOT_FATAL for step in fatal_steps], dtype=torch.bool)
    scored = torch.tensor([reason is None for reason in reasons], dtype=torch.bool)
    index = scored.nonzero().flatten()
    pre_clamp = torch.zeros(n, dtype=torch.float32)
    advantages = torch.zeros(n, dtype=torch.float32)
    if index.numel():
        r = torch.tensor([float(rewards[i]) for i in index.tolist()], dtype=torch.float64)
        g = torch.tensor([int(group_ids[i]) for i in index.tolist()], dtype=torch.int64)
        f = fatal[index]
        kwargs = dict(estimator=config.estimator, std=config.std, eps=config.eps)
        pre_clamp[index] = group_advantages(r, g, f, clamp_fatal=False, **kwargs)
        if config.mode == "fatal_clamp":
            advantages[index] = group_advantages(r, g, f, clamp_fatal=True, **kwargs)
        else:
            advantages[index] = pre_clamp[index]

    keep = scored.clone()
    if config.mode == "hard_mask":
        hard = scored & fatal
        keep &= ~fatal
        advantages[hard] = 0.0
        reasons = [DROP_HARD_MASKED if bool(hard[i]) else reasons[i] for i in range(n)]
    masks_fatal = config.mode in ("fatal_mask", "fatal_clamp")
    loss_fatal_steps = torch.tensor([step if masks_fatal else NOT_FATAL for step in fatal_steps], dtype=torch.int64)
    return AdvantageBatch(
        advantages=advantages,
        pre_clamp=pre_clamp,
        loss_fatal_steps=loss_fatal_steps,
        is_fatal=fatal,
        in_statistics=scored,
        keep=keep,
        drop_reasons=tuple(reasons),
        mode=config.mode,
    )


def trajectory_advantages(
    trajectories: Sequence[Trajectory], config: AdvantageConfig = AdvantageConfig()
) -> AdvantageBatch:
    """:func:`compute_advantages` over scored trajectories (see :func:`osvl.rl.rewards.score_batch`)."""
    unscored = [t.sample_index for t in trajectories if t.reward is None]
    if unscored:
        raise ValueError(
            f"{len(unscored)} trajectories carry no reward record; score the batch before computing advantages"
        )
    exclusions = [
        None if t.reward.scored else DROP_INFRA if t.reward.unscored_reason == INFRA_UNSCORED else DROP_UNSCORED
        for t in trajectories
    ]
    return compute_advantages(
        rewards=[t.reward.total for t in trajectories],
        group_ids=[t.group_id for t in trajectories],
        fatal_steps=[t.fatal_step for t in trajectories],
        config=config,
        exclusions=exclusions,
    )
