"""bench_grpo_loss.py end to end on tiny CPU shapes: runs, writes a well-formed JSON record.

Numbers are checked for shape and consistency, never for speed.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.kernels.bench_grpo_loss import main, parse_args
from bench.kernels.cases import CASES

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--device",
    "cpu",
    "--tokens",
    "48",
    "--vocab",
    "61",
    "--hidden",
    "8",
    "--seqs",
    "4",
    "--warmup",
    "1",
    "--reps",
    "2",
]
# Every case's numerics are checked in test_cases.py; here one of each family keeps the run short.
CLI_CASES = ["osvl_grpo_loss", "torch_eager", "osvl_linear_grpo_loss", "torch_eager_linear", "liger_fused_linear_grpo"]
TOP_KEYS = {
    "schema",
    "name",
    "complete",
    "created_utc",
    "argv",
    "git",
    "device",
    "versions",
    "env",
    "shape",
    "settings",
    "floors",
    "reference_loss",
    "cases",
    "summary",
}
OK_KEYS = {
    "median_ms",
    "min_ms",
    "max_ms",
    "reps",
    "peak_extra_bytes",
    "memory_method",
    "loss",
    "loss_abs_diff_vs_reference",
    "floor_ms",
    "percent_of_floor",
    "time_ratio_vs",
    "memory_ratio_vs",
}


def numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def check_record(record: dict, expected_cases: list[str]) -> dict:
    assert TOP_KEYS <= record.keys() and record["complete"] is True
    assert record["schema"] == "osvl.bench.grpo_loss/1"
    assert all(math.isfinite(x) for x in numbers(record))
    assert [c["name"] for c in record["cases"]] == expected_cases
    by_name = {c["name"]: c for c in record["cases"]}
    ok = [c for c in record["cases"] if c["status"] == "ok"]
    for case in record["cases"]:
        assert case["status"] in ("ok", "unavailable", "error")
        assert case["kind"] == CASES[case["name"]][0]
        if case["status"] != "ok":
            assert case["reason"]
            continue
        assert OK_KEYS <= case.keys()
        assert 0 < case["min_ms"] <= case["median_ms"] <= case["max_ms"]
        assert case["loss_abs_diff_vs_reference"] < 1e-4  # every case computed the same objective
        for other, r in case["time_ratio_vs"].items():
            assert r == pytest.approx(case["median_ms"] / by_name[other]["median_ms"])
            assert r * by_name[other]["time_ratio_vs"][case["name"]] == pytest.approx(1.0)
        assert set(case["time_ratio_vs"]) == {c["name"] for c in ok} - {case["name"]}
    return by_name


def test_cases_run_in_process_and_write_json(tmp_path, capsys):
    rc = main(
        [
            *TINY,
            "--out-dir",
            str(tmp_path),
            "--no-cpu-memory",
            "--cases",
            ",".join(CLI_CASES),
            "--peak-tbps",
            "0.05",
            "--peak-tflops",
            "1.0",
        ]
    )
    assert rc == 0
    [path] = tmp_path.glob("grpo_loss-cpu-*.json")
    record = json.loads(path.read_text())
    by_name = check_record(record, CLI_CASES)
    assert all(c["status"] == "ok" for c in by_name.values()), {n: c["reason"] for n, c in by_name.items()}
    floors = record["floors"]["logits"]
    assert floors["issue_floor_bytes"] == 4 * 48 * 61 * 4
    osvl = by_name["osvl_grpo_loss"]
    assert osvl["percent_of_floor"] == pytest.approx(100 * floors["floor_ms"] / osvl["median_ms"])
    assert by_name["osvl_linear_grpo_loss"]["achieved_tflops"] > 0
    assert record["summary"]["logits_percent_of_issue_floor"]["met"] is None  # targets are judged on GPU only
    assert "wrote" in capsys.readouterr().out


def test_interleaved_run_records_the_same_cases_and_the_load(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # one unavailable case among the interleaved ones
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", None)
    names = ["osvl_grpo_loss", "liger_fused_linear_grpo", "torch_eager"]
    assert main([*TINY, "--out-dir", str(tmp_path), "--no-cpu-memory", "--interleave", "--cases", ",".join(names)]) == 0
    record = json.loads(next(tmp_path.glob("grpo_loss-cpu-*.json")).read_text())
    by_name = check_record(record, names)
    assert [by_name[n]["status"] for n in names] == ["ok", "unavailable", "ok"]
    assert record["settings"]["interleave"] is True
    env = record["env"]
    assert env["torch_threads"] == torch.get_num_threads() and len(env["loadavg_1_5_15"]) == 3
    assert len(env["loadavg_after"]) == 3


def test_script_file_with_memory_probes(tmp_path):
    """The Makefile's invocation (a file path, not -m) with per-case RSS subprocesses."""
    cmd = [
        sys.executable,
        str(REPO / "bench/kernels/bench_grpo_loss.py"),
        "--device",
        "cpu",
        "--tokens",
        "256",
        "--vocab",
        "4096",
        "--hidden",
        "16",
        "--seqs",
        "4",
        "--warmup",
        "1",
        "--reps",
        "1",
        "--cases",
        "torch_eager,osvl_grpo_loss",
        "--osvl-backend",
        "torch",
        "--out-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(next(tmp_path.glob("grpo_loss-cpu-*.json")).read_text())
    by_name = check_record(record, ["torch_eager", "osvl_grpo_loss"])
    logits_fp32_bytes = 256 * 4096 * 4
    # the materialised baseline holds at least its fp32 log_softmax output
    assert by_name["torch_eager"]["peak_extra_bytes"] >= logits_fp32_bytes
    assert "VmHWM" in by_name["torch_eager"]["memory_method"]
    ratio = record["summary"]["osvl_grpo_loss_peak_memory_ratio_vs_torch_eager"]["value"]
    assert ratio == pytest.approx(
        by_name["osvl_grpo_loss"]["peak_extra_bytes"] / by_name["torch_eager"]["peak_extra_bytes"]
    )


def test_unavailable_library_is_recorded_not_raised(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", None)
    assert (
        main([*TINY, "--out-dir", str(tmp_path), "--no-cpu-memory", "--cases", "liger_fused_linear_grpo,torch_eager"])
        == 0
    )
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    liger, eager = record["cases"]
    assert liger["status"] == "unavailable" and liger["reason"].startswith("unavailable: liger-kernel not installed")
    assert eager["status"] == "ok" and eager["time_ratio_vs"] == {}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cases", "torch_eager,cce"], "unknown or empty --cases"),
        (["--tokens", "0"], "num_tokens"),
        (["--seqs", "100", "--tokens", "10"], "num_seqs"),
        (["--reps", "0"], "--reps"),
        (["--liger-chunk-size", "0"], "--liger-chunk-size"),
    ],
)
def test_bad_arguments_are_value_errors(argv, message, tmp_path, capsys):
    with pytest.raises(ValueError, match=message):
        parse_args(["--device", "cpu", *argv])
    assert main(["--device", "cpu", "--out-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cuda_without_a_gpu_is_a_value_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        parse_args(["--device", "cuda"])


def test_cpu_defaults():
    config = parse_args(["--device", "cpu"])
    assert (config.shape.num_tokens, config.shape.vocab) == (2048, 32000)
    assert (config.warmup, config.reps, config.options.osvl_backend, config.options.liger_compiled) == (
        1,
        3,
        "torch",
        False,
    )
