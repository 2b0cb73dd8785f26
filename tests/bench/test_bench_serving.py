"""bench/rollout/bench_serving.py end to end at the smallest sizes: a well-formed record, never a speed."""

from __future__ import annotations

import json
import math

import pytest

from bench.rollout.bench_serving import main

pytestmark = pytest.mark.slow


def test_serving_bench_writes_a_complete_record(tmp_path):
    out = tmp_path / "serving.json"
    main(
        [
            "--repeats",
            "1",
            "--prompts",
            "1",
            "--group-size",
            "2",
            "--max-new-tokens",
            "4",
            "--sizes",
            "tiny",
            "small",
            "--out",
            str(out),
        ]
    )
    record = json.loads(out.read_text())
    assert record["schema"] == "osvl.bench.serving/1" and record["git"]["commit"]
    runs = record["throughput"]
    assert set(runs) == {"in_process", "sglang_protocol"} and runs["in_process"]["ratio_vs_in_process"] == 1.0
    assert runs["sglang_protocol"]["trajectories"] == runs["in_process"]["trajectories"] == 2  # equal work
    sync = record["weight_sync"]
    assert sync["small"]["params"] > sync["tiny"]["params"]
    for row in sync.values():
        assert row["disk"]["bytes"] > row["distributed"]["bytes"] * 0.99 > 0  # files add a header
        assert len(row["disk"]["seconds_all"]) == 2
    fit = record["extrapolation"]
    assert fit["targets"]["qwen3_vl_30b_a3b"]["bf16_bytes"] > fit["targets"]["qwen3_vl_8b"]["bf16_bytes"] > 1e10
    assert all(
        math.isfinite(v)
        for path in fit["fit_seconds"].values()
        for k, v in path.items()
        if k != "bytes_per_s" and v is not None
    )
