"""bench_async.py end to end on a tiny workload: runs N = 0 and 1, writes a well-formed JSON record.

Numbers are checked for shape and consistency, never for speed."""

import json
import math

import pytest

from bench.rollout.bench_async import SCHEMA, main


def test_bench_async_writes_a_record(tmp_path):
    out = tmp_path / "async.json"
    record = main(["--staleness", "0", "1", "--steps", "2", "--turn-s", "0.02", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["schema"] == SCHEMA and record["git"]["short"]
    sync, overlapped = record["settings"]
    assert (sync["max_staleness"], overlapped["max_staleness"]) == (0, 1)
    for s in record["settings"]:
        assert s["steady_steps"] == 1 and s["steps_per_hour"] > 0 and math.isfinite(s["steps_per_hour"])
        assert 0 <= s["trainer_idle_frac"] <= 1 and 0 <= s["generator_idle_frac"] <= 1
        assert 0 <= s["long_share_trained"] <= 1 and s["stale_groups"] >= 0 and s["regenerated"] == 0
        assert s["speedup_vs_sync"] == pytest.approx(s["steps_per_hour"] / sync["steps_per_hour"])
    assert sync["group_lag_mean"] == 0 and sync["offpolicy_token_frac"] == 0  # N = 0 is on-policy
    assert overlapped["group_lag_mean"] <= 1


def test_bench_async_needs_the_synchronous_baseline():
    with pytest.raises(SystemExit, match="must include 0"):
        main(["--staleness", "1", "2"])
