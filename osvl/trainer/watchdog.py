"""No silent hang: every wait of the GRPO loop has a deadline derived from the recipe, and a rank that
passes one stops the run loudly, with every rank, after what can be saved.

- The rollout wait (``RolloutGenerator.next_batch``) lasts at most :func:`step_deadline_s`: the waves of
  trajectories a rank's groups take at ``rollout.max_in_flight``, each under its deadline and retries,
  then their judging under the judges' timeouts, attempts and back-off. ``rollout.step_deadline_s``
  sets it by hand.
- Every collective waits at most :func:`collective_timeout_s` (the process group's timeout, gloo and
  NCCL alike): the rollout deadline plus room for the update, the weight sync and a checkpoint.
  ``job.collective_timeout_s`` sets it by hand.
- Service calls carry their own timeouts (engine requests, tool calls, judge requests).
- Before any deadline passes, a rank that keeps waiting for its groups prints what for every
  ``WAIT_REPORT_S`` seconds: a long wait is never a silent one.

A rank past its rollout deadline, or whose rollout generator failed, does not raise alone: the step's
all-gather is where the ranks agree
(:func:`osvl.trainer.grpo.rollout_step`), so every rank learns it together, logs what each waited for,
writes the checkpoint of the last finished step when it has none and stops with :class:`RunStopped`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from osvl.config.recipe import Recipe

SLACK_S = 60.0  # beyond the sum of the parts: scheduling, scoring bookkeeping, a loaded host
AFTER_ROLLOUT_S = 1800.0  # a collective's room beyond the rollout wait: the update, the weight sync, a checkpoint
WAIT_REPORT_S = 60.0  # a rank still waiting for its groups says so this often, before its deadline


class RunStopped(RuntimeError):
    """The run stopped on purpose after a fault it cannot heal; the message is the one line to print."""


@dataclass(frozen=True)
class Overdue:
    """One rank without its step's groups: what it waited for, or what failed."""

    rank: int
    report: str


class StepOverdue(RuntimeError):
    """Raised on every rank together when any rank cannot give its step's groups (past its deadline, or
    its rollout generator failed)."""

    def __init__(self, ranks: list[Overdue]) -> None:
        super().__init__("; ".join(f"rank {o.rank}: {o.report}" for o in ranks))
        self.ranks = ranks


def judge_verdict_s(recipe: Recipe) -> float:
    """The longest one LLM verdict may take: every attempt to its timeout, the longest pause a server may ask
    for between attempts, and the overload window."""
    j = recipe.judges
    return j.max_attempts * j.timeout_s + (j.max_attempts - 1) * 120.0 + j.overload_wait_s


def step_deadline_s(recipe: Recipe, dp_size: int) -> float:
    """How long a rank may wait for one step's scored groups (``rollout.step_deadline_s`` when set)."""
    r, g = recipe.rollout, recipe.grpo
    if r.step_deadline_s:
        return r.step_deadline_s
    trajectories = max(1, g.batch_prompts // dp_size) * g.group_size
    waves = math.ceil(trajectories / r.max_in_flight)
    llm_judges = sum(kind == "llm" for kind in (recipe.judges.accuracy, recipe.judges.query))
    return waves * r.trajectory_deadline_s * (r.max_retries + 1) + llm_judges * judge_verdict_s(recipe) + SLACK_S


def collective_timeout_s(recipe: Recipe, dp_size: int) -> float:
    """How long a collective may wait for the slowest rank (``job.collective_timeout_s`` when set)."""
    if recipe.job.collective_timeout_s:
        return recipe.job.collective_timeout_s
    rollout = step_deadline_s(recipe, dp_size) if recipe.job.stage == "grpo" else 0.0
    return rollout + AFTER_ROLLOUT_S


def stop_message(step: int, late: list[Overdue], saved: str) -> str:
    """The one line every rank stops with."""
    who = "; ".join(f"rank {o.rank}: {o.report}" for o in late)
    return f"step {step}: the rollouts did not arrive ({who}); {saved}"
