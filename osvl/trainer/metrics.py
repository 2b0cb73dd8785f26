"""Per-step metrics: JSONL (the record of a run), TensorBoard when installed, a console line.

Only rank 0 writes. Values are plain floats: callers reduce across ranks before logging. A resumed
run first cuts both records back to its checkpoint's step (``truncate_metrics``,
``truncate_tensorboard``), so every step is recorded once, by the attempt that reached it last.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import torch

from osvl.config.loader import recipe_to_dict
from osvl.config.recipe import Recipe
from osvl.jsonl import iter_jsonl


def peak_memory_gib() -> float:
    """Peak CUDA allocation, or this process's peak resident set on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def progress_line(step: int, total: int, values: dict[str, float], width: int = 20) -> str:
    filled = int(width * step / total) if total else width
    bar = "#" * filled + "." * (width - filled)
    shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
    return f"[{bar}] {step}/{total} {shown}"


def _fmt(value: float) -> str:
    if value == 0 or not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


class MetricsWriter:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        tensorboard: bool,
        console: bool,
        header: dict[str, Any] | None = None,
        stream: TextIO = sys.stdout,
    ) -> None:
        self.enabled, self.console, self.stream = enabled, console, stream
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if header is not None:
            (self.path.parent / "recipe.json").write_text(json.dumps(header, indent=2))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))

    def log(self, step: int, total: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in values.items()}}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, float(value), step)
            self._tb.flush()
        if self.console:
            print(progress_line(step, total, values), file=self.stream, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def stage_metrics(recipe: Recipe, rank: int) -> MetricsWriter:
    """The stage's writer in ``job.run_dir``, headed by the full recipe; silent off rank 0."""
    return MetricsWriter(
        recipe.job.run_dir,
        enabled=rank == 0,
        tensorboard=recipe.metrics.tensorboard,
        console=recipe.metrics.console,
        header=recipe_to_dict(recipe),
    )


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The run's records, one per logged step. A step at or below the one before it starts a new
    attempt that supersedes the records it repeats (a file from before resumes truncated it)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl")
    records: list[dict[str, float]] = []
    for _, record in iter_jsonl(path):
        while records and records[-1]["step"] >= record["step"]:
            records.pop()
        records.append(record)
    return records


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def truncate_metrics(run_dir: str | Path, after: int) -> tuple[list[int], int]:
    """Drops ``metrics.jsonl`` records of steps after ``after`` and lines that do not parse (a line
    torn by a kill); returns the dropped steps and the number of unreadable lines. Atomic."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return [], 0
    kept, dropped, unreadable = [], [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            unreadable += 1
            continue
        if step > after:
            dropped.append(step)
        else:
            kept.append(line + "\n")
    if dropped or unreadable:
        _replace(path, "".join(kept))
    return sorted(set(dropped)), unreadable


def truncate_tensorboard(run_dir: str | Path, after: int) -> int:
    """Rewrites the run's TensorBoard event files without the scalars of steps after ``after`` (and
    without a record torn by a kill); returns how many events were dropped. Each file is replaced
    atomically; a file with nothing to drop is left as it is."""
    directory = Path(run_dir) / "tensorboard"
    for leftover in directory.glob("events.out.tfevents.*.tmp"):  # a rewrite cut short: its original is intact
        leftover.unlink()
    files = sorted(p for p in directory.glob("events.out.tfevents.*") if p.suffix != ".tmp")
    if not files:
        return 0
    try:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        raise RuntimeError(
            f"{directory} holds TensorBoard events but tensorboard is not installed, so they cannot "
            f"be cut back to step {after}: install tensorboard or remove {directory}"
        ) from None

    def beyond(record: bytes) -> bool:
        event = Event.FromString(record)
        return event.HasField("summary") and event.step > after

    dropped = 0
    for path in files:
        raw = list(RawEventFileLoader(str(path)).Load())
        kept = [r for r in raw if not beyond(r)]
        torn = path.stat().st_size != sum(len(r) + 16 for r in raw)  # 16 = length, two CRCs
        if len(kept) == len(raw) and not torn:
            continue
        dropped += len(raw) - len(kept)
        tmp = path.with_name(path.name + ".tmp")
        writer = RecordWriter(open(tmp, "wb"))  # noqa: SIM115 (RecordWriter closes it)
        for record in kept:
            writer.write(record)
        writer.close()
        os.replace(tmp, path)
    return dropped
