"""bench/device_check.sh: the dry-run plan leaves room for a rerun in 15 device minutes and bench/README.md's
command line allows it; --smoke runs every stage (or says why not), records each as it finishes,
summarises, and leaves in $OUT only what the GPU machine hands back; a failing stage fails the run;
the budget cuts stages; a stage past its limit leaves its output and where it hung."""

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
STAGES = ["environment", "wheels", "gpu_tests", "logits", "linear", "train_loop", "train_step"]
GPU_MINUTES = 15  # two runs, each after a machine start, must fit a quarter hour of GPU time
MACHINE_START_S = 120  # a cold start of a GPU machine


def run(tmp_path, *args, env_extra=None, timeout=1200):
    # No carried wheels: the stages run on this Python's own packages, whatever .whl/ holds here. Python's
    # output settings as on the GPU machine (unset), not as this shell may have them.
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")},
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "DEVICE_CHECK_WHEELS": str(tmp_path / "no-wheels"),
        **(env_extra or {}),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_dry_run_wall_and_the_readme_command_leave_room_for_a_rerun(tmp_path):
    proc = run(tmp_path, "--dry-run", timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[1 : 1 + len(STAGES)]] == STAGES  # priority order
    wall = int(re.search(r"wall <= (\d+)s", proc.stdout).group(1))
    # The command for the GPU machine, as the dry run prints it and bench/README.md gives it: its limit covers
    # the run, and two machine starts with two runs fit in a quarter hour.
    [limit_s] = re.findall(r"^on the GPU machine .*, limit (\d+)s:$", proc.stdout, re.M)
    [commit] = re.findall(r"^OSVL_COMMIT=(\S+) bash bench/device_check\.sh$", proc.stdout, re.M)
    assert re.fullmatch(r"[0-9a-f]{40}", commit)  # this checkout's HEAD, filled in
    readme = (REPO / "bench" / "README.md").read_text()
    assert re.search(r"^OSVL_COMMIT=<commit> bash bench/device_check\.sh$", readme, re.M)
    assert f"under a wall limit of {limit_s} s" in readme and wall <= int(limit_s)
    assert 2 * (MACHINE_START_S + int(limit_s)) <= GPU_MINUTES * 60
    assert not (tmp_path / "device_check").exists()  # nothing ran


def returned_files(out: Path) -> list[str]:
    """What the GPU machine would not hand back from `out` (at most 8 files, 2 folders down, 16 MiB
    each, 64 MiB in all, names of letters, digits, '.', '_' and '-')."""
    files = [p for p in out.rglob("*") if p.is_file()]
    problems = [f"{len(files)} files"] if len(files) > 8 else []
    for path in files:
        parts = path.relative_to(out).parts
        if len(parts) > 3 or not all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in parts):
            problems.append(str(path))
        if path.stat().st_size > 16 * 2**20:
            problems.append(f"{path} is too large")
    if sum(p.stat().st_size for p in files) > 64 * 2**20:
        problems.append("over 64 MiB")
    return problems


def test_smoke_run_records_every_stage_and_the_summary(tmp_path):
    # The limits are sized for the GPU machine: scaled up so a loaded CPU host cannot time a stage out.
    proc = run(tmp_path, "--smoke", env_extra={"DEVICE_CHECK_LIMIT_PCT": "1000", "DEVICE_CHECK_BUDGET_S": "5000"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = [json.loads(line) for line in (tmp_path / "device_check" / "stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == STAGES
    assert "no wheels" in stages[1]["skipped"]
    for s in stages[:1] + stages[2:]:
        assert s["rc"] == 0 and not s["timed_out"], s
    log = (tmp_path / "device_check" / "run.log").read_text()  # one log for every stage
    assert all(f"== {stage}" in log for stage in STAGES) and "test_measure.py::" in log  # pytest -v names tests
    assert returned_files(tmp_path) == [] and len([p for p in tmp_path.rglob("*") if p.is_file()]) == 8
    for name in ("device_logits", "device_linear"):
        [path] = tmp_path.glob(f"{name}-*.json")
        record = json.loads(path.read_text())
        assert record["complete"] and [c["status"] for c in record["cases"]][0] == "ok"
    linear = json.loads(next(tmp_path.glob("device_linear-*.json")).read_text())
    assert linear["matmul"]["tflops"] > 0 and linear["cases"][0]["percent_of_measured_matmul_floor"] > 0
    train = json.loads(next(tmp_path.glob("device_train_step-*.json")).read_text())
    assert train["summary"]["tokens_per_s"] > 0 and 0 < train["summary"]["loss_time_share"] < 1
    assert train["complete"] and [s["step"] for s in train["steps"]] == [0, 1]
    summary = json.loads((tmp_path / "device_check" / "summary.json").read_text())
    assert summary["failed"] == [] and [s["stage"] for s in summary["stages"]] == STAGES
    assert summary["return_problems"] == [] and summary["unreadable_results"] == []
    table = {row["number"].strip(): row["value"] for row in summary["table"]}
    assert table["tokens/s"] != "—"
    loop = json.loads(next(tmp_path.glob("device_train_loop-*.json")).read_text())
    assert loop["complete"] and len(loop["sft_steps"]) == 2 and len(loop["grpo_steps"]) == 2
    assert loop["summary"]["grpo_tool_calls_mean"] >= 1 and loop["summary"]["grpo_rollout_tokens_per_s"] > 0
    assert table["rollout tokens/s (engine)"] != "—" and table["tool calls per rollout"] != "—"
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


def fake_python(tmp_path: Path, environment_code: str = "") -> Path:
    """A Python whose every stage fails (exit 3) but the summary; the environment stage runs
    `environment_code` instead where one is given."""
    fake = tmp_path / "python"
    environment = f'case "$2" in *python_version*) exec {sys.executable} -c "{environment_code}" ;; esac\n'
    fake.write_text(
        "#!/bin/sh\n"
        + (environment if environment_code else "")
        + f'if [ "$1" = -m ] && [ "$2" = bench.device_summary ]; then exec {sys.executable} "$@"; fi\nexit 3\n'
    )
    fake.chmod(0o755)
    return fake


def test_failing_stage_is_recorded_and_fails_the_run(tmp_path):
    """A Python that cannot import torch: every stage fails, the script still finishes and says so."""
    proc = run(tmp_path / "out", "--smoke", env_extra={"PYTHON": str(fake_python(tmp_path))}, timeout=120)
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "out" / "device_check" / "summary.json").read_text())
    assert "environment" in summary["failed"] and "logits" in summary["failed"]


def test_stage_past_its_limit_leaves_its_output_and_where_it_hung(tmp_path):
    """The environment stage hangs: SIGABRT at its limit makes Python print where it was, and the
    output it printed before (unflushed, as a plain print is) is in the log."""
    fake = fake_python(tmp_path, "import time; print('before the hang'); time.sleep(600)")
    out = tmp_path / "out"
    proc = run(out, "--smoke", env_extra={"PYTHON": str(fake), "DEVICE_CHECK_LIMIT_PCT": "10"}, timeout=120)
    assert proc.returncode == 1
    environment = json.loads((out / "device_check" / "stages.jsonl").read_text().splitlines()[0])
    assert environment["stage"] == "environment" and environment["timed_out"] and environment["limit"] == 3
    log = (out / "device_check" / "run.log").read_text()
    assert "before the hang" in log and "Fatal Python error: Aborted" in log
    assert 'File "<string>", line 1 in <module>' in log


def test_a_stage_that_floods_the_log_keeps_its_first_and_last_mebibyte(tmp_path):
    """The one log must stay a file the GPU machine hands back (16 MiB): a stage's share is 2 MiB."""
    flood = "import sys; sys.stdout.write('first line' + chr(10) + 'x' * 5 * 2**20 + chr(10) + 'last line' + chr(10))"
    out = tmp_path / "out"
    proc = run(out, "--smoke", env_extra={"PYTHON": str(fake_python(tmp_path, flood))}, timeout=120)
    assert proc.returncode == 1
    log = (out / "device_check" / "run.log").read_text()
    environment = log[: log.index("== environment: rc=0")]
    assert environment.startswith("== environment (limit 30s") and "first line" in environment
    assert "last line" in environment and "bytes of output left out ...]" in environment
    assert 2 * 2**20 < len(environment) < 2 * 2**20 + 200 and len(log) < 2 * 2**20 + 2000


def test_rejects_unknown_arguments_and_a_malformed_commit(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--fast"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = run(tmp_path, "--smoke", env_extra={"OSVL_COMMIT": "HEAD"}, timeout=30)
    assert proc.returncode == 2 and "OSVL_COMMIT must be 7-40 lowercase hex digits" in proc.stderr
    assert not (tmp_path / "device_check").exists()


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
