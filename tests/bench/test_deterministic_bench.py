"""bench/rollout/bench_deterministic.py end to end on the smallest workload (no timing assertions)."""

from __future__ import annotations

import json
import sys

import pytest

from bench.rollout import bench_deterministic


def test_writes_both_modes_and_their_ratio(tmp_path, monkeypatch):
    out = tmp_path / "result.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_deterministic",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--set",
            "grpo.max_response_tokens=8",
            "--set",
            "rollout.max_turns=1",
            "--set",
            "grpo.batch_prompts=2",
            "--set",
            "grpo.mini_batch_prompts=2",
            "--set",
            "tools.workers=1",
        ],
    )
    bench_deterministic.main()
    result = json.loads(out.read_text())
    assert result["schema"] == bench_deterministic.SCHEMA and result["git"]["short"]
    for mode in ("batched", "deterministic"):
        run = result["runs"][mode]
        assert run["step1_rollouts"] == 8 and len(run["step_time_s_all"]) == 1 and run["step_time_s"] > 0
    assert set(result["deterministic_vs_batched"]) == {"step_time_s", "time_rollout_s"}


def test_bad_arguments(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_deterministic", "--steps", "1"])
    with pytest.raises(SystemExit):
        bench_deterministic.main()
    assert "--steps must be >= 2" in capsys.readouterr().err
