"""Composite trajectory reward (paper Eq. 9): ``r = r_fmt * (alpha * r_acc + (1 - alpha) * r_query)``.

``r_fmt`` is a deterministic structure check and acts as a multiplicative gate; ``r_acc`` and
``r_query`` come from judges. Process rewards (``r_fmt``, ``r_query``) are computed over the
valid pre-fatal prefix only, so a rollout is not penalised twice for the collapse that made it
fatal. A fatal rollout has no creditable answer: ``r_acc = 0`` by rule, no judge asked.

When a judge cannot answer, the whole sample is *unscored* (``total=None``) and is later
excluded from its group; it is never silently scored 0. So is a rollout our infrastructure broke,
unless ``infra_rollouts = "keep"`` makes a tool back-end's failure part of the rollout to score.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from osvl.rl.fatal import (
    INFRA_ROLLOUTS,
    FatalConfig,
    InfraRollouts,
    infra_excluded,
    is_fatal,
    trajectory_fatal_step,
    valid_prefix,
)
from osvl.rl.judges import AccuracyJudge, QueryJudge, Verdict
from osvl.rl.trajectory import POLICY_ERRORS, RewardParts, Step, Trajectory

log = logging.getLogger(__name__)

INFRA_UNSCORED = "infra_error"


@dataclass(frozen=True)
class RewardConfig:
    """Reward weights, the fatal rule that bounds the process rewards, and whether a rollout that met a
    tool's ``infra_error`` is scored (``keep``) or left unscored (``drop``)."""

    alpha: float = 0.8  # weight of accuracy against query quality
    fatal: FatalConfig = field(default_factory=FatalConfig)
    infra_rollouts: InfraRollouts = "drop"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.infra_rollouts not in INFRA_ROLLOUTS:
            raise ValueError(f"infra_rollouts must be one of {INFRA_ROLLOUTS}, got {self.infra_rollouts!r}")


_STEP_SHAPE = re.compile(
    r"\s*<think>(?P<think>.*?)</think>\s*<(?P<kind>tool_call|response)>(?P<body>.*?)</(?P=kind)>\s*", re.DOTALL
)
_ANY_TAG = re.compile(r"</?(?:think|tool_call|response)>")


def step_format_valid(step: Step, is_last: bool) -> bool:
    """One ``<think>`` block immediately followed by one ``<tool_call>`` or, last, ``<response>``.

    Only whitespace may surround or separate the blocks; blocks may not nest or repeat. A tool
    call whose execution failed through the policy's fault (bad arguments, unparsable, timeout)
    also makes the step invalid.
    """
    match = _STEP_SHAPE.fullmatch(step.text)
    if match is None or _ANY_TAG.search(match["think"]) or _ANY_TAG.search(match["body"]):
        return False
    if match["kind"] == "response":
        return is_last
    return step.status not in POLICY_ERRORS


def format_reward(steps: Sequence[Step]) -> float:
    """Fraction of well-formed steps in ``steps``; 0 for no steps (nothing was done right)."""
    if not steps:
        return 0.0
    last = len(steps) - 1
    return sum(step_format_valid(step, i == last) for i, step in enumerate(steps)) / len(steps)


def composite_reward(fmt: float, acc: float, query: float, alpha: float = 0.8) -> float:
    """Eq. 9: the format score gates a blend of accuracy and query quality."""
    return fmt * (alpha * acc + (1.0 - alpha) * query)


def _ask(judge_call, *args) -> Verdict:
    """Run one judge call; a bug or crash inside a judge marks the sample unscored, not the batch."""
    try:
        return judge_call(*args)
    except Exception as exc:  # noqa: BLE001 - errors are data: one bad judge call must not kill the batch
        log.warning("judge raised %s: %s", type(exc).__name__, exc)
        return Verdict(None, f"judge_exception:{type(exc).__name__}: {exc}")


def score_trajectory(
    traj: Trajectory, accuracy_judge: AccuracyJudge, query_judge: QueryJudge, config: RewardConfig = RewardConfig()
) -> Trajectory:
    """A copy of ``traj`` with its fatal step and reward parts filled in."""
    fatal_step = trajectory_fatal_step(traj, config.fatal)
    prefix = valid_prefix(traj.steps, fatal_step)
    fmt = format_reward(prefix)
    if infra_excluded(traj, config.infra_rollouts):
        reward = RewardParts(fmt=fmt, acc=None, query=None, total=None, unscored_reason=INFRA_UNSCORED)
        return dataclasses.replace(traj, fatal_step=fatal_step, reward=reward)

    answer = traj.final_answer
    if is_fatal(fatal_step) or answer is None:
        acc = Verdict(0.0, "fatal: no creditable answer")
    else:
        acc = _ask(accuracy_judge.judge_answer, traj.prompt, answer)
    if any(step.tool_call is not None or step.tool_result is not None for step in prefix):
        query = _ask(query_judge.judge_queries, traj.prompt, prefix)
    else:
        query = Verdict(0.0, "no tool calls in the valid prefix")

    failed = [f"{part}:{v.reason}" for part, v in (("accuracy", acc), ("query", query)) if not v.scored]
    total = None if failed else composite_reward(fmt, acc.score, query.score, config.alpha)
    reward = RewardParts(
        fmt=fmt, acc=acc.score, query=query.score, total=total, unscored_reason="; ".join(failed) or None
    )
    return dataclasses.replace(traj, fatal_step=fatal_step, reward=reward)


def score_batch(
    trajectories: Sequence[Trajectory],
    accuracy_judge: AccuracyJudge,
    query_judge: QueryJudge,
    config: RewardConfig = RewardConfig(),
    max_workers: int = 8,
) -> list[Trajectory]:
    """Score every trajectory (judges run concurrently); same length and order as the input."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda t: score_trajectory(t, accuracy_judge, query_judge, config), trajectories))
