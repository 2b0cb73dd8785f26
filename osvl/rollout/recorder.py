"""Every finished trajectory to JSONL (+ content-addressed PNGs) so a run can be inspected and replayed."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from osvl.rl.trajectory import Trajectory, append_jsonl, read_jsonl

_STEP_FILE = re.compile(r"rollouts_step(\d+)\.jsonl(\.tmp)?")


class RolloutRecorder:
    """One file per step, ``<directory>/rollouts_step<N>.jsonl``, with images in ``<directory>/images``.

    A step's file is written whole and replaced atomically, so a step that runs again (after a
    resume) is recorded once and a kill mid-write leaves the previous file or none, never half of one.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.written = 0

    def path(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.directory / f"rollouts_step{step:06d}.jsonl"

    def write(self, step: int, trajectories: Iterable[Trajectory]) -> int:
        """Records ``step``'s trajectories, replacing any earlier record of that step; returns how many."""
        path = self.path(step)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        count = append_jsonl(tmp, trajectories, self.directory / "images")
        os.replace(tmp, path)
        self.written += count
        return count

    def steps(self) -> list[int]:
        """The steps with a complete record, in order."""
        if not self.directory.is_dir():
            return []
        found = (_STEP_FILE.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m and not m.group(2))

    def discard_after(self, step: int) -> list[int]:
        """Removes the records of steps after ``step`` and any half-written file; returns the steps removed.
        Images stay: they are content-addressed and may be shared with the steps kept."""
        if not self.directory.is_dir():
            return []
        removed = []
        for path in self.directory.iterdir():
            match = _STEP_FILE.fullmatch(path.name)
            if match and (match.group(2) or int(match.group(1)) > step):
                path.unlink()
                if not match.group(2):
                    removed.append(int(match.group(1)))
        return sorted(removed)

    def read(self, step: int) -> list[Trajectory]:
        path = self.path(step)
        if not path.is_file():
            raise ValueError(f"no rollouts recorded for step {step} at {path}")
        return list(read_jsonl(path, self.directory / "images"))
