"""bench/device_check.sh in --smoke mode: every stage runs (or says why not) and is recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "device_check.sh"


def test_smoke_run_records_every_stage(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--smoke"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "device_check" / "summary.json").read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    assert {"environment", "wheels", "gpu_tests", "bench_grpo_loss", "train_dry_run"} <= stages.keys()
    assert summary["failed"] == []
    for name in ("environment", "gpu_tests", "bench_grpo_loss", "train_dry_run"):
        assert stages[name]["rc"] == 0 and not stages[name]["timed_out"]
        assert Path(stages[name]["log"]).is_file()
    [result] = tmp_path.glob("device_check_smoke-*.json")
    record = json.loads(result.read_text())
    assert record["complete"] and [c["status"] for c in record["cases"]] == ["ok", "ok"]


def test_failing_stage_is_recorded_and_fails_the_run(tmp_path):
    """A Python that cannot import torch: every stage fails, the script still finishes and says so."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = - ]; then exec {sys.executable} \"$@\"; fi\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake)}
    proc = subprocess.run(["bash", str(SCRIPT), "--smoke"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "out" / "device_check" / "summary.json").read_text())
    assert "environment" in summary["failed"] and "bench_grpo_loss" in summary["failed"]


def test_rejects_unknown_arguments():
    proc = subprocess.run(["bash", str(SCRIPT), "--fast"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr
