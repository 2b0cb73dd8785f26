"""The metrics trackers beside metrics.jsonl, with the network off: an offline W&B run and an MLflow run on a local
SQLite store get every logged step and the recipe, read back from what they wrote; a resumed stage continues the same
tracker run; a tracker that is on but not installed stops the launch naming its extra; a stage run through the
trainer writes its steps to both."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from wandb.proto import wandb_internal_pb2

from osvl.config import load_recipe
from osvl.config.loader import recipe_toml
from osvl.config.recipe import MLflowConfig, WandbConfig
from osvl.train import main
from osvl.trainer import read_metrics, run_sft
from osvl.trainer.metrics import TRACKERS_FILE, MetricsWriter, missing_trackers
from tests.trainer.fixtures import sft_overrides, write_sft_data

OFFLINE = WandbConfig(mode="offline")
LOCAL = MLflowConfig(enabled=True)
RECIPE = {"job": {"name": "probe"}, "grpo": {"eps_high": 0.28, "tools": ["ocr", "crop"]}}


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """W&B offline without console capture, system stats or error reports; MLflow without telemetry."""
    for key, value in {
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-home"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-home"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-home"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }.items():
        monkeypatch.setenv(key, value)


def wandb_records(run_file: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header, then 32 KiB blocks of chunks,
    each a 7-byte header (CRC, length, kind: full, first, middle, last) and its bytes."""
    data, block, position, pending, records = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def latest_wandb_run(run_dir: Path) -> tuple[str, dict, list[dict[str, float]]]:
    """The newest attempt's run id, its config and its history rows (W&B's own ``_`` keys left out)."""
    (run_file,) = (run_dir / "wandb" / "latest-run").glob("run-*.wandb")
    run_id, config, history = "", {}, []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            row = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history.append({k: v for k, v in row.items() if not k.startswith("_")})
    return run_id, config, history


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> MLflowConfig:
    """One SQLite store for the module's MLflow runs: a new store's schema takes seconds to create."""
    return MLflowConfig(enabled=True, tracking_uri=f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")


def mlflow_run(run_dir: Path) -> tuple[MlflowClient, str]:
    stored = json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"]
    return MlflowClient(tracking_uri=stored["tracking_uri"]), stored["run_id"]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def attempt(run_dir: Path, steps: dict[int, float], resumed: bool, recipe: dict = RECIPE, **trackers) -> None:
    writer = MetricsWriter(
        run_dir, enabled=True, tensorboard=False, console=False, header=recipe, resumed=resumed, **trackers
    )
    for step, loss in steps.items():
        writer.log(step, 4, {"loss": loss, "val/accuracy": step / 10})
    writer.close()


def test_an_offline_wandb_run_holds_every_step_and_the_recipe(tmp_path):
    attempt(tmp_path, {1: 0.9, 2: 0.7, 3: 0.6}, resumed=False, wandb=OFFLINE)
    run_id, config, rows = latest_wandb_run(tmp_path)
    assert rows == [{"step": s, "loss": loss, "val/accuracy": s / 10} for s, loss in ((1, 0.9), (2, 0.7), (3, 0.6))]
    assert config["job"] == {"name": "probe"} and config["grpo"]["tools"] == ["ocr", "crop"]
    assert json.loads((tmp_path / TRACKERS_FILE).read_text())["wandb"] == {"id": run_id}


def test_an_mlflow_run_holds_every_step_and_the_recipe(tmp_path, store):
    attempt(tmp_path, {1: 0.9, 2: 0.7}, resumed=False, mlflow=store)
    client, run_id = mlflow_run(tmp_path)
    assert history(client, run_id, "loss") == [(1, 0.9), (2, 0.7)]
    assert history(client, run_id, "val/accuracy") == [(1, 0.1), (2, 0.2)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "probe"
    assert run.data.params == {"job.name": "probe", "grpo.eps_high": "0.28", "grpo.tools": '["ocr", "crop"]'}


def test_a_resumed_stage_continues_its_tracker_runs_and_a_fresh_one_starts_new_ones(tmp_path, store, capsys):
    attempt(tmp_path, {1: 0.9, 2: 0.7, 3: 0.6}, resumed=False, wandb=OFFLINE, mlflow=store)
    first_wandb, _, _ = latest_wandb_run(tmp_path)
    client, first_mlflow = mlflow_run(tmp_path)
    changed = {**RECIPE, "grpo": {**RECIPE["grpo"], "eps_high": 0.3}, "sft": {"epochs": 2}}
    attempt(
        tmp_path, {3: 0.5, 4: 0.4}, resumed=True, recipe=changed, wandb=OFFLINE, mlflow=store
    )  # the relaunch from step 2's checkpoint

    run_id, _, rows = latest_wandb_run(tmp_path)
    assert run_id == first_wandb and [r["step"] for r in rows] == [3, 4]
    assert mlflow_run(tmp_path)[1] == first_mlflow
    assert history(client, first_mlflow, "loss") == [(1, 0.9), (2, 0.7), (3, 0.5), (3, 0.6), (4, 0.4)]
    params = client.get_run(first_mlflow).data.params
    assert params["grpo.eps_high"] == "0.28" and params["sft.epochs"] == "2"  # MLflow params never change
    assert "keeps the first value of params grpo.eps_high" in capsys.readouterr().err

    attempt(tmp_path, {1: 1.0}, resumed=False, wandb=OFFLINE, mlflow=store)  # a fresh start in the same run directory
    assert latest_wandb_run(tmp_path)[0] != first_wandb and mlflow_run(tmp_path)[1] != first_mlflow


def test_the_trackers_are_recipe_keys_checked_and_printed_like_any_other(tmp_path):
    recipe = load_recipe("tiny_sft", ["metrics.wandb.mode=online", "metrics.mlflow.tracking_uri=http://mlflow:5000"])
    assert (
        recipe.metrics.wandb == WandbConfig(mode="online")
        and recipe.metrics.mlflow.tracking_uri == "http://mlflow:5000"
    )
    (tmp_path / "printed.toml").write_text(recipe_toml(recipe))
    assert load_recipe(tmp_path / "printed.toml") == recipe
    for override, message in [
        ("metrics.wandb.mode=onlin", "metrics.wandb.mode: 'onlin' is not one of"),
        ("metrics.wandb.projet=x", "did you mean metrics.wandb.project?"),
        ("metrics.wandb.project=", "metrics.wandb: project must not be empty"),
        ("metrics.mlflow.experiment=", "metrics.mlflow: experiment must not be empty"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_recipe("tiny_sft", [override])


@pytest.mark.parametrize(
    ("module", "tensorboard", "wandb", "mlflow", "extra", "off"),
    [
        ("tensorboard", True, WandbConfig(), MLflowConfig(), "tensorboard", "metrics.tensorboard=false"),
        ("wandb", False, OFFLINE, MLflowConfig(), "wandb", "metrics.wandb.mode=disabled"),
        ("mlflow", False, WandbConfig(), LOCAL, "mlflow", "metrics.mlflow.enabled=false"),
        ("sqlalchemy", False, WandbConfig(), LOCAL, "mlflow", "metrics.mlflow.enabled=false"),
    ],
)
def test_a_tracker_that_is_on_but_not_installed_is_an_error_naming_its_extra(
    monkeypatch, tmp_path, module, tensorboard, wandb, mlflow, extra, off
):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    expected = f"metrics.{extra} is on but {module} is not installed: pip install 'osvl[{extra}]' (or --set {off})"
    assert missing_trackers(tensorboard, wandb, mlflow) == [expected]
    trackers = {"tensorboard": tensorboard, "console": False, "wandb": wandb, "mlflow": mlflow}
    with pytest.raises(RuntimeError) as raised:
        MetricsWriter(tmp_path / "run", enabled=True, **trackers)
    assert str(raised.value) == expected and not (tmp_path / "run").exists()
    MetricsWriter(tmp_path / "run", enabled=False, **trackers)  # off rank 0 nothing is written, nothing is needed


def test_a_tracking_server_needs_no_local_store_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    assert missing_trackers(False, WandbConfig(), MLflowConfig(enabled=True, tracking_uri="http://mlflow:5000")) == []
    assert missing_trackers(False, WandbConfig(), MLflowConfig()) == []  # off: nothing to install


def test_the_launch_stops_before_any_process_group_when_a_tracker_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    overrides = sft_overrides(tmp_path / "data", tmp_path / "run", "metrics.wandb.mode=offline")
    write_sft_data(tmp_path / "data")
    assert main(["--recipe", "tiny_sft", *(x for o in overrides for x in ("--set", o))]) == 2
    assert "pip install 'osvl[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_stage_through_the_trainer_writes_its_steps_to_both_trackers_across_a_resume(tmp_path):
    overrides = sft_overrides(
        tmp_path / "data",
        tmp_path / "run",
        "sft.max_steps=3",
        "checkpoint.every_steps=1",
        "metrics.console=false",
        "metrics.tensorboard=false",
        "metrics.wandb.mode=offline",
        "metrics.mlflow.enabled=true",
    )
    run = tmp_path / "run"
    assert run_sft(load_recipe("tiny_sft", overrides), stop_after=2).steps == 2
    first, config, rows = latest_wandb_run(run)
    assert [r["step"] for r in rows] == [1, 2] and config["sft"]["max_steps"] == 3
    assert run_sft(load_recipe("tiny_sft", overrides)).resumed_from == 2

    losses = [(int(r["step"]), r["loss"]) for r in read_metrics(run)]
    run_id, _, rows = latest_wandb_run(run)
    assert run_id == first and [(r["step"], r["loss"]) for r in rows] == losses[2:]
    client, mlflow_id = mlflow_run(run)
    assert client.tracking_uri == f"sqlite:///{run / 'mlflow.db'}"  # the default: a store in the run directory
    assert history(client, mlflow_id, "loss") == losses
    assert client.get_run(mlflow_id).data.params["job.stage"] == "sft"
