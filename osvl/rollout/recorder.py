"""Every finished trajectory to JSONL (+ content-addressed PNGs) so a run can be inspected and replayed."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from osvl.rl.trajectory import Trajectory, append_jsonl, read_jsonl


class RolloutRecorder:
    """Appends to ``<directory>/rollouts_step<N>.jsonl`` with images in ``<directory>/images``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.written = 0

    def path(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.directory / f"rollouts_step{step:06d}.jsonl"

    def write(self, step: int, trajectories: Iterable[Trajectory]) -> int:
        count = append_jsonl(self.path(step), trajectories, self.directory / "images")
        self.written += count
        return count

    def read(self, step: int) -> list[Trajectory]:
        path = self.path(step)
        if not path.is_file():
            raise ValueError(f"no rollouts recorded for step {step} at {path}")
        return list(read_jsonl(path, self.directory / "images"))
