"""bench/profile.py on tiny_sft for one step: a loadable Chrome trace and a table with every phase."""

from __future__ import annotations

import json

import pytest

from bench.profile import PHASES, breakdown, main, markdown
from tests.trainer.fixtures import sft_overrides


def test_profile_tiny_sft(tmp_path):
    overrides = [o for o in sft_overrides(tmp_path / "data", tmp_path / "unused") if not o.startswith("job.run_dir")]
    args = [
        "--recipe",
        "tiny_sft",
        "--steps",
        "1",
        "--out",
        str(tmp_path / "out"),
        "--set",
        "metrics.tensorboard=false",
    ]
    assert main(args + [x for o in overrides for x in ("--set", o)]) == 0
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the training matmuls were profiled
    result = json.loads((tmp_path / "out" / "breakdown.json").read_text())
    (row,) = result["rows"]
    assert set(PHASES["sft"]) <= row.keys() and row["step"] == 1
    assert sum(row[k] for k in PHASES["sft"]) <= row["step_time_s"] * 1.01 and row["model_tflops"] > 0
    assert "mfu" not in row  # a CPU has no peak in the table: no made-up number
    assert result["git"]["commit"] and result["device"] == "cpu"
    table = (tmp_path / "out" / "breakdown.md").read_text()
    assert all(k in table for k in PHASES["sft"])


def test_breakdown_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown stage"):
        breakdown("ppo", [{"step": 1}])
    with pytest.raises(ValueError, match="time_data_s"):
        breakdown("sft", [{"step": 1, "step_time_s": 1.0}])
    rows = breakdown(
        "grpo",
        [
            {
                "step": 1,
                "time_rollout_s": 1,
                "time_tools_s": 0.5,
                "time_advantages_s": 0.05,
                "time_pack_s": 0.05,
                "time_train_s": 2,
                "time_sync_s": 0.2,
                "step_time_s": 3.3,
                "loss": 9,
            }
        ],
    )
    assert "loss" not in rows[0] and markdown(rows).count("|") > 10
