"""Per-step metrics: JSONL (the record of a run), a console line, and the trackers the recipe turns on
(TensorBoard, Weights & Biases, MLflow), each a sink that gets every logged step.

Only rank 0 writes. Values are plain floats: callers reduce across ranks before logging. A resumed
run first cuts ``metrics.jsonl`` and the TensorBoard events back to its checkpoint's step (``truncate_metrics``,
``truncate_tensorboard``), so every step is recorded once, by the attempt that reached it last. A W&B or
MLflow run cannot be cut: a resumed stage continues the same tracker run (its id is kept in
``trackers.json`` in the run directory) and logs the steps after the checkpoint again, after the first
attempt's values of them. A tracker that is on but not installed is an error naming its extra, never a
silent off.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from osvl.config.loader import recipe_to_dict
from osvl.config.recipe import MLflowConfig, Recipe, WandbConfig
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


TRACKERS_FILE = "trackers.json"  # the W&B and MLflow run ids a resumed stage continues


def missing_trackers(tensorboard: bool, wandb: WandbConfig, mlflow: MLflowConfig) -> list[str]:
    """One line per tracker that is on but whose packages are not installed: its extra and how to turn it off."""
    wanted = []  # (extra, its modules, how to turn it off)
    if tensorboard:
        wanted.append(("tensorboard", ("tensorboard",), "metrics.tensorboard=false"))
    if wandb.mode != "disabled":
        wanted.append(("wandb", ("wandb",), "metrics.wandb.mode=disabled"))
    if mlflow.enabled:  # the local store needs SQLAlchemy and Alembic, a tracking server does not
        modules = ("mlflow",) if mlflow.tracking_uri else ("mlflow", "sqlalchemy", "alembic")
        wanted.append(("mlflow", modules, "metrics.mlflow.enabled=false"))
    lines = []
    for extra, modules, off in wanted:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            lines.append(
                f"metrics.{extra} is on but {', '.join(missing)} is not installed: pip install 'osvl[{extra}]' "
                f"(or --set {off})"
            )
    return lines


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _stored_run(run_dir: Path, tracker: str) -> dict[str, str]:
    path = run_dir / TRACKERS_FILE
    return json.loads(path.read_text(encoding="utf-8")).get(tracker, {}) if path.is_file() else {}


def _store_run(run_dir: Path, tracker: str, entry: dict[str, str]) -> None:
    path = run_dir / TRACKERS_FILE
    stored = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    _replace(path, json.dumps({**stored, tracker: entry}, indent=2))


class WandbSink:
    """One W&B run per stage, continued by a resumed stage (``resume="allow"`` with the stored id). Values are
    plotted against ``step``, a metric of their own rather than W&B's ``_step``: W&B refuses a ``_step`` below
    the run's last, so the steps a resumed stage trains again would be dropped; this way both attempts' values
    of them are kept, the resumed one logged later."""

    def __init__(self, config: WandbConfig, run_dir: Path, name: str, recipe: dict[str, Any], resumed: bool) -> None:
        import wandb

        run_id = _stored_run(run_dir, "wandb").get("id") if resumed else None
        self.run = wandb.init(
            project=config.project,
            entity=config.entity or None,
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            mode=config.mode,
            dir=config.dir or str(run_dir),
            config=recipe,
        )
        _store_run(run_dir, "wandb", {"id": self.run.id})
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()


def _params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The recipe as MLflow params: ``{"grpo.eps_high": "0.28", ...}``."""
    params = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            params.update(_params(value, f"{prefix}{key}."))
        else:
            params[prefix + key] = json.dumps(value) if isinstance(value, list) else str(value)
    return params


class MLflowSink:
    """One MLflow run per stage, continued by a resumed stage (the stored run id, on the same tracking URI).
    Params cannot change in MLflow: a resumed run adds the keys it lacks and says which ones it keeps the
    first value of (``recipe.json`` holds the resumed recipe)."""

    def __init__(self, config: MLflowConfig, run_dir: Path, name: str, recipe: dict[str, Any], resumed: bool) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        uri = config.tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        stored = _stored_run(run_dir, "mlflow") if resumed else {}
        params = {k: v[:MAX_PARAM_VAL_LENGTH] for k, v in _params(recipe).items()}
        if stored.get("tracking_uri") == uri:
            self.run_id = stored["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params
            kept = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
            if kept:
                print(f"mlflow: run {self.run_id} keeps the first value of params {', '.join(kept)}", file=sys.stderr)
            params = {k: v for k, v in params.items() if k not in logged}
        else:
            experiment = self.client.get_experiment_by_name(config.experiment)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:  # a local store keeps its artifact folder beside it, not in the working directory
                artifacts = None if config.tracking_uri else (run_dir / "mlflow-artifacts").resolve().as_uri()
                experiment_id = self.client.create_experiment(config.experiment, artifact_location=artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            _store_run(run_dir, "mlflow", {"tracking_uri": uri, "run_id": self.run_id})
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


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
        wandb: WandbConfig | None = None,
        mlflow: MLflowConfig | None = None,
        resumed: bool = False,
    ) -> None:
        """``header`` (the recipe) goes to ``recipe.json`` and is the trackers' config; ``resumed``: the stage
        continues from a checkpoint, so W&B and MLflow continue the run they started before."""
        self.enabled, self.console, self.stream = enabled, console, stream
        self.path = Path(run_dir) / "metrics.jsonl"
        self.sinks: list[Sink] = []
        if not enabled:
            return
        wandb, mlflow = wandb or WandbConfig(), mlflow or MLflowConfig()
        missing = missing_trackers(tensorboard, wandb, mlflow)
        if missing:
            raise RuntimeError("; ".join(missing))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        recipe = header or {}
        if header is not None:
            (self.path.parent / "recipe.json").write_text(json.dumps(header, indent=2))
        name = recipe.get("job", {}).get("name", self.path.parent.name)
        if tensorboard:
            self.sinks.append(TensorBoardSink(self.path.parent))
        if wandb.mode != "disabled":
            self.sinks.append(WandbSink(wandb, self.path.parent, name, recipe, resumed))
        if mlflow.enabled:
            self.sinks.append(MLflowSink(mlflow, self.path.parent, name, recipe, resumed))

    def log(self, step: int, total: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        values = {k: float(v) for k, v in values.items()}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
        for sink in self.sinks:
            sink.log(step, values)
        if self.console:
            print(progress_line(step, total, values), file=self.stream, flush=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def stage_metrics(recipe: Recipe, rank: int, resumed: bool = False) -> MetricsWriter:
    """The stage's writer in ``job.run_dir``, headed by the full recipe; silent off rank 0. ``resumed``: the
    stage continues from a checkpoint."""
    return MetricsWriter(
        recipe.job.run_dir,
        enabled=rank == 0,
        tensorboard=recipe.metrics.tensorboard,
        console=recipe.metrics.console,
        header=recipe_to_dict(recipe),
        wandb=recipe.metrics.wandb,
        mlflow=recipe.metrics.mlflow,
        resumed=resumed,
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
