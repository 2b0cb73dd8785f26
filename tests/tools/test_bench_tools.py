import json

import pytest

from bench.tools import bench_tools as bench


def test_every_benchmark_input_is_a_valid_successful_call(tmp_path):
    config = bench.build_world(tmp_path, documents=50)
    cases = bench.workloads()
    assert sorted(cases) == sorted(bench.ALL_TOOLS)
    for tool in ("crop", "sharpen", "perspective_correct", "text_search", "image_search"):
        result = bench.bench_inprocess(tool, *cases[tool], config, calls=2)
        assert result.errors == 0 and result.calls == 2 and result.p50_ms > 0 and result.mode == "inprocess"


def test_summary_statistics_and_ratios():
    result = bench.summarise("crop", "pool", 1, 2, [0.010, 0.020, 0.030, 0.040], wall=0.05, errors=0)
    assert result.calls_per_s == pytest.approx(80.0)
    assert result.p50_ms == pytest.approx(25.0) and result.mean_ms == pytest.approx(25.0)
    assert 39.0 < result.p99_ms <= 40.0
    base = bench.summarise("crop", "inprocess", 0, 1, [0.005] * 4, wall=0.02, errors=0)
    two = bench.summarise("crop", "pool", 2, 2, [0.010] * 4, wall=0.025, errors=0)
    table = bench.ratios([base, result, two])["crop"]
    assert table["pool1_p50_over_inprocess_p50"] == pytest.approx(5.0)
    assert table["pool2_p50_over_inprocess_p50"] == pytest.approx(2.0)
    assert table["pool2_over_pool1_calls_per_s"] == pytest.approx(2.0)
    assert table["pool1_calls_per_s_over_inprocess"] == pytest.approx(80.0 / 200.0)


def test_main_writes_json_with_the_commit(tmp_path):
    assert (
        bench.main(
            [
                "--tools",
                "crop",
                "--workers",
                "1",
                "--calls",
                "3",
                "--concurrency",
                "2",
                "--documents",
                "10",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    (path,) = tmp_path.glob("tools-cpu-*.json")
    record = json.loads(path.read_text())
    assert record["schema"] == bench.SCHEMA and record["complete"] is True
    assert record["git_commit"] is None or len(record["git_commit"]) == 40
    assert [(r["mode"], r["workers"], r["errors"]) for r in record["results"]] == [("inprocess", 0, 0), ("pool", 1, 0)]
    assert "pool1_p50_over_inprocess_p50" in record["ratios"]["crop"]
    with pytest.raises(SystemExit):
        bench.main(["--tools", "teleport"])


def test_sandbox_bench_measures_every_backend_and_writes_ratios(tmp_path):
    from bench.tools import bench_sandbox

    assert bench_sandbox.main(["--calls", "2", "--workloads", "pass", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("sandbox-cpu-*.json")
    record = json.loads(path.read_text())
    assert record["schema"] == bench_sandbox.SCHEMA
    assert record["git_commit"] is None or len(record["git_commit"]) == 40
    cases = {(r["backend"], r["workload"]): r for r in record["results"]}
    assert set(cases) == {(b, "pass") for b in [*bench_sandbox.BACKENDS, "bare_python"]}
    assert all(r["errors"] == 0 and r["calls"] == 2 and r["p50_ms"] > 0 for r in cases.values())
    assert "namespaces_p50_over_unsafe_no_boundary_p50" in record["ratios"]["pass"]
    with pytest.raises(SystemExit):
        bench_sandbox.main(["--workloads", "teleport"])


def test_overload_bench_runs_both_client_modes_and_counts_every_call(tmp_path):
    from bench.tools import bench_overload

    argv = ["--callers", "3", "--calls", "2", "--workers", "1", "--queue", "1", "--call-s", "0.05"]
    assert bench_overload.main([*argv, "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("overload-cpu-*.json")
    record = json.loads(path.read_text())
    assert record["schema"] == bench_overload.SCHEMA and record["config"]["queue"] == 1
    assert [r["mode"] for r in record["results"]] == list(bench_overload.MODES)
    for r in record["results"]:
        assert r["calls"] == 6 == r["ok"] + r["infra_error"] + r["other"] and r["server_ran"] == r["ok"]
        assert r["p99_s"] >= r["p50_s"] > 0
    waited = record["results"][1]
    assert waited["ok"] == 6 and waited["overloaded"] == 0  # healthy calls within a 20 s deadline
    with pytest.raises(SystemExit):
        bench_overload.main(["--modes", "teleport"])
