"""The replay buffer of asynchronous GRPO: scored groups waiting for the trainer, and the staleness bound.

A group is a prompt's G scored samples, whole. Its policy version is that of its oldest token
(tokens keep the version that generated them, also across a weight update: see
``rollout.partial_rollouts``). The trainer holds version ``V`` (optimizer steps taken) and pushes
its weights once per rollout step of ``updates_per_step`` optimizer steps, so a group of version
``v`` is ``lag = ceil((V - v) / updates_per_step)`` weight syncs old; it may be trained on only if
``lag <= max_staleness`` (0 = only groups of the trainer's current weights: the synchronous step).

Groups leave oldest ticket first (the order the prompts were drawn in), so a group waits as few
steps as the bound allows and a synchronous run takes each step's groups in prompt order.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from osvl.rl.trajectory import Trajectory


@dataclass(frozen=True, order=True)
class Ticket:
    """One prompt's group to roll out. The stream batch it was drawn in and its position there fix
    its sampling seeds and injected tool faults, so a restarted, regenerated or resumed group is
    rolled out the same way; they also order the groups."""

    batch: int  # index of the prompt-stream batch it was drawn in
    position: int  # the prompt's position in that batch (its group id in a synchronous step)
    prompt_index: int  # into the RL prompt set
    attempt: int = 0  # regenerations after going stale (rollout.stale_groups = "regenerate")

    def regenerated(self) -> Ticket:
        return dataclasses.replace(self, attempt=self.attempt + 1)


@dataclass
class ScoredGroup:
    ticket: Ticket
    trajectories: list[Trajectory]  # the G samples, scored

    @property
    def version(self) -> int | None:
        """Policy version of the group's oldest token; None when no sample generated one."""
        versions = [
            min(step.token_versions) if step.token_versions else step.policy_version
            for trajectory in self.trajectories
            for step in trajectory.steps
        ]
        return min(versions) if versions else None


def lag(version: int, current: int, updates_per_step: int) -> int:
    """Weight syncs between the policy version ``version`` and the trainer's ``current`` one."""
    if updates_per_step < 1:
        raise ValueError(f"updates_per_step must be >= 1, got {updates_per_step}")
    return max(-(-(current - version) // updates_per_step), 0)


class ReplayBuffer:
    """At most ``capacity`` scored groups, oldest ticket first. Not thread-safe: its owner (the
    rollout generator) holds a lock around every call."""

    def __init__(self, capacity: int, max_staleness: int, updates_per_step: int) -> None:
        if capacity < 1 or max_staleness < 0 or updates_per_step < 1:
            raise ValueError(
                f"need capacity >= 1, max_staleness >= 0 and updates_per_step >= 1, got {capacity}, "
                f"{max_staleness} and {updates_per_step}"
            )
        self.capacity, self.max_staleness, self.updates_per_step = capacity, max_staleness, updates_per_step
        self._groups: list[ScoredGroup] = []

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def groups(self) -> list[ScoredGroup]:
        return list(self._groups)

    def is_fresh(self, group: ScoredGroup, current: int) -> bool:
        """Whether the trainer at version ``current`` may train on ``group``."""
        version = group.version
        return version is None or lag(version, current, self.updates_per_step) <= self.max_staleness

    def put(self, group: ScoredGroup) -> None:
        if len(self._groups) >= self.capacity:
            raise RuntimeError(f"replay buffer full ({self.capacity} groups): the generator admitted too many")
        if any(g.ticket == group.ticket for g in self._groups):
            raise ValueError(f"{group.ticket} is already in the replay buffer")
        bisect.insort(self._groups, group, key=lambda g: g.ticket)

    def drop_stale(self, current: int) -> list[ScoredGroup]:
        """Removes and returns the groups the trainer at ``current`` may no longer train on."""
        stale = [g for g in self._groups if not self.is_fresh(g, current)]
        self._groups = [g for g in self._groups if self.is_fresh(g, current)]
        return stale

    def take(self, n: int) -> list[ScoredGroup]:
        """The ``n`` oldest groups, removed."""
        if n > len(self._groups):
            raise ValueError(f"asked for {n} groups, {len(self._groups)} in the buffer")
        taken, self._groups = self._groups[:n], self._groups[n:]
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [(g.ticket, g.trajectories) for g in self._groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._groups = []
        for ticket, trajectories in state["groups"]:
            self.put(ScoredGroup(ticket, list(trajectories)))


def _token_versions(trajectory: Trajectory) -> Counter:
    """Generated tokens per policy version."""
    counts: Counter = Counter()
    for step in trajectory.steps:
        if step.token_versions:
            counts.update(step.token_versions)
        else:
            counts[step.policy_version] += len(step.token_ids)
    return counts


def staleness_metrics(groups: Sequence[ScoredGroup], current: int, updates_per_step: int) -> dict[str, float]:
    """How off-policy a step's batch is, per group and per generated token (lags in weight syncs):
    ``group_lag_mean`` / ``group_lag_max``, ``token_lag_mean``, ``offpolicy_token_frac`` (tokens of
    older weights than the trainer's) and ``mixed_version_trajectories`` (turns of more than one version)."""
    group_lags = [lag(g.version, current, updates_per_step) for g in groups if g.version is not None]
    per_trajectory = [_token_versions(t) for g in groups for t in g.trajectories]
    tokens: Counter = sum(per_trajectory, Counter())
    total = max(sum(tokens.values()), 1)
    token_lag = {v: lag(v, current, updates_per_step) for v in tokens}
    return {
        "group_lag_mean": sum(group_lags) / max(len(group_lags), 1),
        "group_lag_max": float(max(group_lags, default=0)),
        "token_lag_mean": sum(token_lag[v] * n for v, n in tokens.items()) / total,
        "offpolicy_token_frac": sum(n for v, n in tokens.items() if token_lag[v] > 0) / total,
        "mixed_version_trajectories": float(sum(len(+c) > 1 for c in per_trajectory)),
    }
