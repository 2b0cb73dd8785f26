"""Smoke test of the SFT-data benchmark on a tiny synthetic corpus (no timing asserts)."""

from __future__ import annotations

import json

from bench.packing.bench_sft_data import run, synthetic_corpus
from osvl.data.tokenizer import load_tokenizer


def test_benchmark_record_counts_what_each_arm_decodes(tmp_path):
    data, tokenizer = synthetic_corpus(tmp_path, num_trajectories=24, num_images=5)
    result = json.loads(
        json.dumps(run(data, load_tokenizer(tokenizer), ranks=2, batch=4, max_tokens=4096, patch_size=16))
    )
    assert result["schema"] == "osvl.bench.sft_data/1" and "commit" in result["git"]
    eager, deferred = result["eager"], result["deferred"]
    assert eager["tokens"] == deferred["tokens"] > 0
    assert eager["image_decodes"] == 24 * 3  # prompt, observation and tool result of each record
    assert deferred["decodes_during_load"] == 0 and deferred["pixel_bytes_held_after_load"] == 0
    assert 0 < deferred["image_decodes"] <= deferred["image_files"] <= 5  # rank 0's share, each file once
    assert eager["pixel_bytes_held_after_load"] == 24 * 2 * 96 * 128 * 3  # two 384x512 images a sequence, resized
    assert result["decode_ratio"] == eager["image_decodes"] / deferred["image_decodes"]
