"""Batch bookkeeping for the one-sided clamp (paper Figure 5) and for excluded samples.

Figure 5 splits the fatal rollouts by their pre-clamp group score: the ones below zero are
zeroed by the clamp (91.8% in the paper, mean score -0.68), the rest are preserved (8.2%,
mean +0.57) and sit near the non-fatal rollouts. The split is computed from the pre-clamp score
in every mode, so the non-clamping ablations report what the clamp *would* have done.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from osvl.rl.advantages import DROP_HARD_MASKED, DROP_INFRA, DROP_UNSCORED, AdvantageBatch
from osvl.rl.fatal import has_infra_error
from osvl.rl.trajectory import Trajectory


@dataclass(frozen=True)
class BatchStats:
    """Counts and the Figure 5 split; means are None when their set is empty."""

    sequences: int
    scored: int  # counted in group statistics
    unscored: int  # a judge could not answer
    infra_dropped: int  # rollouts hit by infra errors, dropped whole
    hard_masked: int  # fatal rollouts dropped by the hard_mask mode
    fatal: int  # scored and fatal
    clamped: int  # fatal with a negative pre-clamp score (zeroed by the clamp)
    preserved: int  # fatal with a non-negative pre-clamp score
    fatal_fraction: float | None  # fatal / scored
    clamped_fraction: float | None  # clamped / fatal
    mean_pre_clamp_zeroed: float | None
    mean_pre_clamp_preserved: float | None
    mean_pre_clamp_nonfatal: float | None
    infra_retries: int = 0  # rollouts re-run because of infra errors before this batch
    infra_kept: int = 0  # scored rollouts that met a tool's infra_error (grpo.infra_rollouts = "keep")
    unscored_reasons: dict[str, int] = field(default_factory=dict)  # judge failure -> count

    def as_metrics(self, prefix: str = "rl/") -> dict[str, float]:
        """Flat numeric metrics for the logger; empty means and reason tables are left out."""
        metrics = {}
        for name, value in asdict(self).items():
            if isinstance(value, dict):
                metrics.update({f"{prefix}unscored_reason/{k}": float(v) for k, v in value.items()})
            elif value is not None:
                metrics[prefix + name] = float(value)
        return metrics


def _mean(values: torch.Tensor) -> float | None:
    return float(values.double().mean()) if values.numel() else None


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def batch_stats(batch: AdvantageBatch, trajectories: Sequence[Trajectory] = ()) -> BatchStats:
    """Statistics of one advantage batch; ``trajectories`` (same order) add retries and reasons."""
    scored = batch.in_statistics
    fatal = scored & batch.is_fatal
    zeroed = fatal & (batch.pre_clamp < 0)
    preserved = fatal & ~(batch.pre_clamp < 0)
    nonfatal = scored & ~batch.is_fatal
    drops = Counter(batch.drop_reasons)
    reasons = Counter(
        t.reward.unscored_reason
        for t, why in zip(trajectories, batch.drop_reasons)
        if why == DROP_UNSCORED and t.reward is not None and t.reward.unscored_reason
    )
    n_scored, n_fatal, n_zeroed = int(scored.sum()), int(fatal.sum()), int(zeroed.sum())
    return BatchStats(
        sequences=len(batch.drop_reasons),
        scored=n_scored,
        unscored=drops[DROP_UNSCORED],
        infra_dropped=drops[DROP_INFRA],
        hard_masked=drops[DROP_HARD_MASKED],
        fatal=n_fatal,
        clamped=n_zeroed,
        preserved=int(preserved.sum()),
        fatal_fraction=_ratio(n_fatal, n_scored),
        clamped_fraction=_ratio(n_zeroed, n_fatal),
        mean_pre_clamp_zeroed=_mean(batch.pre_clamp[zeroed]),
        mean_pre_clamp_preserved=_mean(batch.pre_clamp[preserved]),
        mean_pre_clamp_nonfatal=_mean(batch.pre_clamp[nonfatal]),
        infra_retries=sum(t.infra_retries for t in trajectories),
        infra_kept=sum(bool(kept) and has_infra_error(t) for t, kept in zip(trajectories, scored.tolist())),
        unscored_reasons=dict(reasons),
    )


@dataclass(frozen=True)
class GroupSignal:
    """How many of a step's groups can move the policy: GRPO's advantage is zero in a group whose
    rewards are all equal, so only the others carry a gradient; ``accuracy`` counts the groups that
    hold both a right and a wrong answer, the ones that teach accuracy rather than format or queries."""

    groups: int  # groups with at least two scored trajectories
    reward: float | None  # share of them whose rewards are not all equal
    accuracy: float | None  # share of them with both right and wrong answers

    def as_metrics(self) -> dict[str, float]:
        metrics = {"signal_groups": self.reward, "accuracy_signal_groups": self.accuracy}
        return {key: value for key, value in metrics.items() if value is not None}


def group_signal(trajectories: Sequence[Trajectory], tolerance: float = 1e-9) -> GroupSignal:
    """:class:`GroupSignal` of scored trajectories grouped by ``group_id`` (unscored ones left out, as
    the advantages leave them out)."""
    rewards: dict[int, list[tuple[float, float]]] = {}
    for t in trajectories:
        if t.reward is not None and t.reward.scored:
            rewards.setdefault(t.group_id, []).append((t.reward.total, t.reward.acc))
    groups = [members for members in rewards.values() if len(members) >= 2]
    spread = lambda values: max(values) - min(values) > tolerance  # noqa: E731
    return GroupSignal(
        groups=len(groups),
        reward=_ratio(sum(spread([r for r, _ in g]) for g in groups), len(groups)),
        accuracy=_ratio(sum(spread([a for _, a in g]) for g in groups), len(groups)),
    )
