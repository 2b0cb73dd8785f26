"""bench/device_check.sh: the dry-run plan fits 9 minutes; --smoke runs every stage (or says why not),
records each as it finishes and summarises; a failing stage fails the run; the budget cuts stages."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "device_check.sh"
STAGES = ["environment", "wheels", "gpu_tests", "logits", "linear", "train_step"]


def run(tmp_path, *args, env_extra=None, timeout=1200):
    # No carried wheels: the stages run on this Python's own packages, whatever .whl/ holds here.
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "DEVICE_CHECK_WHEELS": str(tmp_path / "no-wheels"),
        **(env_extra or {}),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_dry_run_prints_the_plan_within_nine_minutes(tmp_path):
    proc = run(tmp_path, "--dry-run", timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[1 : 1 + len(STAGES)]] == STAGES  # priority order
    wall = int(re.search(r"wall <= (\d+)s", proc.stdout).group(1))
    assert wall <= 9 * 60
    limits = [int(line.split()[1]) for line in lines[1 : 1 + len(STAGES)]]
    assert sum(limits) + 5 * len(limits) <= wall
    assert not (tmp_path / "device_check").exists()  # nothing ran


def test_smoke_run_records_every_stage_and_the_summary(tmp_path):
    # The limits are sized for the GPU machine: scaled up so a loaded CPU host cannot time a stage out.
    proc = run(tmp_path, "--smoke", env_extra={"DEVICE_CHECK_LIMIT_PCT": "1000", "DEVICE_CHECK_BUDGET_S": "5000"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = [json.loads(line) for line in (tmp_path / "device_check" / "stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == STAGES
    assert "no wheels" in stages[1]["skipped"]
    for s in stages[:1] + stages[2:]:
        assert s["rc"] == 0 and not s["timed_out"] and Path(s["log"]).is_file(), s
    for name in ("device_logits", "device_linear"):
        [path] = tmp_path.glob(f"{name}-*.json")
        record = json.loads(path.read_text())
        assert record["complete"] and [c["status"] for c in record["cases"]][0] == "ok"
    linear = json.loads(next(tmp_path.glob("device_linear-*.json")).read_text())
    assert linear["matmul"]["tflops"] > 0 and linear["cases"][0]["percent_of_measured_matmul_floor"] > 0
    train = json.loads(next(tmp_path.glob("device_train_step-*.json")).read_text())
    assert train["summary"]["tokens_per_s"] > 0 and 0 < train["summary"]["loss_time_share"] < 1
    summary = json.loads((tmp_path / "device_check" / "summary.json").read_text())
    assert summary["failed"] == [] and [s["stage"] for s in summary["stages"]] == STAGES
    table = {row["number"].strip(): row["value"] for row in summary["table"]}
    assert table["tokens/s"] != "—"
    assert "| number | value | target | verdict |" in (tmp_path / "device_check" / "summary.md").read_text()


def test_exhausted_budget_skips_the_remaining_stages(tmp_path):
    """With no budget left every stage is skipped, says why, and the run still summarises (no timing involved)."""
    proc = run(tmp_path, "--smoke", env_extra={"DEVICE_CHECK_BUDGET_S": "0"}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stages = [json.loads(line) for line in (tmp_path / "device_check" / "stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == STAGES
    budget_skips = [s for s in stages if "budget" in (s.get("skipped") or "")]
    assert {s["stage"] for s in budget_skips} >= {"environment", "gpu_tests", "logits", "linear", "train_step"}
    assert not list(tmp_path.glob("device_*.json"))  # nothing ran
    assert (tmp_path / "device_check" / "summary.md").is_file()


def test_failing_stage_is_recorded_and_fails_the_run(tmp_path):
    """A Python that cannot import torch: every stage fails, the script still finishes and says so."""
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = bench.device_summary ]; then exec {sys.executable} "$@"; fi\nexit 3\n'
    )
    fake.chmod(0o755)
    proc = run(tmp_path / "out", "--smoke", env_extra={"PYTHON": str(fake)}, timeout=120)
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "out" / "device_check" / "summary.json").read_text())
    assert "environment" in summary["failed"] and "logits" in summary["failed"]


def test_rejects_unknown_arguments():
    proc = subprocess.run(["bash", str(SCRIPT), "--fast"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_device_wheels_are_pinned_and_leave_the_image_alone():
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "device_wheels.sh"), "--list"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    wheels = proc.stdout.split()
    names = {w.split("==")[0] for w in wheels}
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", w) for w in wheels)  # exact pins only
    assert {"torchtitan", "liger-kernel", "numpy", "pytest"} <= names
    assert not names & {"torch", "triton"}  # the image's own builds stay
