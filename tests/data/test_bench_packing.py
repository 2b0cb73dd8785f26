"""Smoke test of the packed-vs-padded benchmark on a very small workload (no timing asserts)."""

from __future__ import annotations

import json

from bench.packing.bench_packing import Workload, run


def test_benchmark_record_is_consistent():
    w = Workload(
        num_seqs=6,
        min_len=4,
        max_len=48,
        median_len=16,
        padded_batch=3,
        max_tokens=96,
        vocab=64,
        dim=16,
        layers=1,
        heads=2,
    )
    result = json.loads(json.dumps(run(w, repeats=1)))
    assert result["schema"] == "osvl.bench.packing/1" and "commit" in result["git"]
    real = result["real_tokens"]
    assert result["packed"]["processed_tokens"] == real and result["packed"]["wasted_token_frac"] == 0.0
    assert result["padded"]["processed_tokens"] >= real
    assert result["padded"]["wasted_token_frac"] == 1 - real / result["padded"]["processed_tokens"]
    assert result["throughput_ratio_packed_over_padded"] > 0
