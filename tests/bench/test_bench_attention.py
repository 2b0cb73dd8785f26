"""bench_attention.py on tiny shapes: runs and writes a well-formed record (never checks speed)."""

import json

import pytest

from bench.model.bench_attention import main


def test_writes_a_record(tmp_path):
    out = tmp_path / "attention.json"
    result = main(["--out", str(out), "--repeats", "1", "--docs", "2", "--doc-len", "9"])
    assert json.loads(out.read_text()) == result
    assert result["schema"] == "osvl.bench.attention/1" and result["workload"]["docs"] == 2
    assert result["enable_gqa"]["step_s"] > 0 and result["packed_attention"]["step_s"] > 0
    assert result["speedup_packed_over_enable_gqa"] == pytest.approx(
        result["enable_gqa"]["step_s"] / result["packed_attention"]["step_s"])


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must be >= 1"):
        main(["--out", str(tmp_path / "x.json"), "--docs", "0"])
