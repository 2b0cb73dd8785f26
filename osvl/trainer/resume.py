"""What a (re)launch does to the run directory before its first step, and the line that says so.

A job killed between checkpoints leaves records of steps that its newest checkpoint does not
hold; the relaunch resumes from that checkpoint and trains those steps again. Before it does, it
cuts every per-run record back to the checkpoint's step: ``metrics.jsonl`` (what
``python -m osvl.report`` plots), the TensorBoard events, the rollout records, and checkpoints
that are incomplete (a save cut short) or newer (a fresh start with ``checkpoint.resume = false``).
Each step is then recorded once, by the attempt whose weights the run continues from. Rank 0 does
this while it owns the run directory (:mod:`osvl.run_lock`) and prints what it resumed
and what it discarded as the stage's first line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osvl.config.recipe import Recipe
from osvl.rollout.recorder import RolloutRecorder
from osvl.run_lock import held_lock
from osvl.trainer.checkpoint import discard_checkpoints_after
from osvl.trainer.metrics import read_metrics, truncate_metrics, truncate_tensorboard


def step_ranges(steps: list[int] | tuple[int, ...]) -> str:
    """``[5, 6, 7, 9]`` -> ``"5-7, 9"``."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


@dataclass(frozen=True)
class Discarded:
    """The records of steps after the resumed one that a relaunch removed."""

    metrics_steps: tuple[int, ...] = ()
    unreadable_metrics_lines: int = 0  # e.g. a line torn by the kill
    rollout_steps: tuple[int, ...] = ()
    tensorboard_events: int = 0
    checkpoints: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.metrics_steps:
            parts.append(f"metrics of steps {step_ranges(self.metrics_steps)}")
        if self.unreadable_metrics_lines:
            parts.append(f"{self.unreadable_metrics_lines} unreadable metrics line(s)")
        if self.rollout_steps:
            parts.append(f"rollouts of steps {step_ranges(self.rollout_steps)}")
        if self.tensorboard_events:
            parts.append(f"{self.tensorboard_events} TensorBoard events")
        if self.checkpoints:
            parts.append(f"checkpoints {', '.join(self.checkpoints)}")
        return "; ".join(parts) if parts else "nothing"


@dataclass(frozen=True)
class Resumption:
    run_dir: Path
    checkpoint: Path | None  # None: a fresh start
    step: int  # steps the checkpoint holds (0 on a fresh start)
    policy_version: int  # optimizer steps the checkpoint's weights have taken
    total: int  # the stage's step count
    discarded: Discarded
    final_loss: float  # the loss recorded at ``step``; nan when none was

    @property
    def finished(self) -> bool:
        return self.checkpoint is not None and self.step >= self.total

    def line(self) -> str:
        if self.checkpoint is None:
            head = f"start: {self.run_dir} from step 0 of {self.total} (no checkpoint)"
        elif self.finished:
            return (
                f"finished: {self.checkpoint} holds step {self.step} of {self.total} (policy version "
                f"{self.policy_version}); nothing left to train; recorded final loss {self.final_loss:.4f}; "
                f"discarded {self.discarded.describe()}"
            )
        else:
            head = (
                f"resume: {self.checkpoint} at step {self.step} of {self.total} (policy version {self.policy_version})"
            )
        return f"{head}; discarded after step {self.step}: {self.discarded.describe()}"


def recorded_loss(run_dir: str | Path, step: int) -> float:
    """The loss ``metrics.jsonl`` holds for ``step``; nan when there is none."""
    try:
        records = read_metrics(run_dir)
    except ValueError:
        return math.nan
    return next((float(r["loss"]) for r in reversed(records) if r["step"] == step and "loss" in r), math.nan)


def discard_records_after(run_dir: str | Path, step: int) -> Discarded:
    """Cuts every per-run record back to ``step`` (the owner of ``run_dir`` only)."""
    run_dir = Path(run_dir)
    metrics_steps, unreadable = truncate_metrics(run_dir, step)
    return Discarded(
        metrics_steps=tuple(metrics_steps),
        unreadable_metrics_lines=unreadable,
        rollout_steps=tuple(RolloutRecorder(run_dir / "rollouts").discard_after(step)),
        tensorboard_events=truncate_tensorboard(run_dir, step),
        checkpoints=tuple(discard_checkpoints_after(run_dir / "checkpoints", step)),
    )


def resume_records(recipe: Recipe, rank: int, state: dict[str, Any], total: int) -> Resumption:
    """After ``resume_state``: on rank 0, discards the records after the resumed step and prints what
    it resumed and discarded (then how it took over a stale lock, if it did). Every rank gets the
    same ``Resumption`` apart from ``discarded``, which only rank 0 knows."""
    run_dir = Path(recipe.job.run_dir)
    step = state.get("step", 0)
    discarded = discard_records_after(run_dir, step) if rank == 0 else Discarded()
    resumption = Resumption(
        run_dir=run_dir,
        checkpoint=Path(state["checkpoint"]) if state else None,
        step=step,
        policy_version=state.get("policy_version", step),
        total=total,
        discarded=discarded,
        final_loss=recorded_loss(run_dir, step) if state else math.nan,
    )
    if rank == 0:
        print(resumption.line(), flush=True)
        lock = held_lock(run_dir)
        if lock is not None and lock.notice:
            print(f"lock: {lock.notice}", flush=True)
    return resumption
