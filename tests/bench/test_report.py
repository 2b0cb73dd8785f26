"""Result record helpers: ratios, target judgement, file naming, finiteness, the commit, whole writes."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.kernels import report
from bench.kernels.report import (
    add_ratios,
    check_finite,
    device_name,
    device_tag,
    git_info,
    package_version,
    ratio,
    result_path,
    summarize,
    versions,
    write_record,
)


def ok(name, ms, mem, **extra):
    return {"name": name, "status": "ok", "median_ms": ms, "peak_extra_bytes": mem, **extra}


def test_ratios_are_pairwise_and_skip_failed_cases():
    cases = [ok("a", 2.0, 100), ok("b", 4.0, 0), {"name": "c", "status": "unavailable"}]
    add_ratios(cases)
    assert cases[0]["time_ratio_vs"] == {"b": 0.5}
    assert cases[1]["time_ratio_vs"] == {"a": 2.0}
    assert cases[0]["memory_ratio_vs"] == {"b": None}  # division by a zero peak is not a number
    assert "time_ratio_vs" not in cases[2]
    assert ratio(None, 1.0) is None


def test_summary_judges_targets_only_on_gpu():
    cases = [
        ok("osvl_grpo_loss", 1.0, 10, percent_of_floor=90.0),
        ok("osvl_linear_grpo_loss", 1.0, 10),
        ok("liger_fused_linear_grpo", 1.5, 100),
        ok("torch_eager", 3.0, 50),
    ]
    add_ratios(cases)
    gpu = summarize(cases, on_gpu=True)
    assert gpu["logits_percent_of_issue_floor"] == {"value": 90.0, "target": ">= 85.0", "met": True}
    assert gpu["linear_speedup_vs_liger_fused_linear"]["value"] == pytest.approx(1.5)
    assert gpu["linear_speedup_vs_liger_fused_linear"]["met"] is True
    assert gpu["linear_peak_memory_ratio_vs_liger_fused_linear"] == {"value": 0.1, "target": "<= 0.25", "met": True}
    assert gpu["osvl_grpo_loss_peak_memory_ratio_vs_torch_eager"]["value"] == pytest.approx(0.2)
    assert gpu["osvl_linear_peak_memory_ratio_vs_torch_eager_linear"]["value"] is None
    cpu = summarize(cases, on_gpu=False)
    assert cpu["logits_percent_of_issue_floor"]["met"] is None
    slow = summarize([ok("osvl_grpo_loss", 1.0, 10, percent_of_floor=50.0)], on_gpu=True)
    assert slow["logits_percent_of_issue_floor"]["met"] is False


def test_check_finite_rejects_nan_anywhere():
    check_finite({"a": [1.0, {"b": 2}], "c": None})
    with pytest.raises(ValueError, match=r"\$.a\[1\].b"):
        check_finite({"a": [1.0, {"b": float("nan")}]})


def test_result_path_and_write(tmp_path):
    path = result_path(tmp_path / "r", "grpo_loss", "h200", "abc123")
    assert path == tmp_path / "r" / "grpo_loss-h200-abc123.json"
    write_record({"x": 1.5}, path)
    assert path.read_text().strip().startswith("{")
    with pytest.raises(ValueError, match="result name"):
        result_path(tmp_path, "../evil", "cpu", "abc")
    with pytest.raises(ValueError, match="non-finite"):
        write_record({"x": float("inf")}, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_environment_fields(tmp_path, monkeypatch):
    monkeypatch.delenv("OSVL_COMMIT", raising=False)
    assert device_tag(torch.device("cpu")) == "cpu"
    assert device_name(torch.device("cpu"))
    assert git_info(tmp_path) == {"commit": None, "short": "nogit", "dirty": None, "source": None}
    repo = git_info(Path(__file__).resolve().parents[2])
    assert len(repo["commit"]) == 40 and repo["short"] == repo["commit"][:8] and repo["source"] == "git"
    assert versions()["torch"] == torch.__version__
    assert package_version("no-such-package-osvl") is None


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_commit_comes_from_the_run_command_without_git_or_dot_git(tmp_path, monkeypatch, capsys):
    """The GPU machine's copy of the tree may have no .git, a stale one, or no git binary: the commit comes
    from $OSVL_COMMIT when it names one, and a missing git never raises (it used to kill the stages)."""
    monkeypatch.setenv("OSVL_COMMIT", COMMIT)
    named = {"commit": COMMIT, "short": COMMIT[:8], "dirty": None, "source": "OSVL_COMMIT"}
    assert git_info(tmp_path) == named  # git present, no .git
    monkeypatch.setenv("PATH", str(tmp_path / "no-binaries-here"))
    assert git_info(Path(__file__).resolve().parents[2]) == named  # no git binary at all
    monkeypatch.undo()
    monkeypatch.setenv("OSVL_COMMIT", COMMIT)
    assert git_info(Path(__file__).resolve().parents[2]) == named  # a .git there (maybe stale): the named commit wins
    monkeypatch.setenv("OSVL_COMMIT", "../../etc")
    assert git_info(tmp_path) == {"commit": None, "short": "nogit", "dirty": None, "source": None}
    assert "OSVL_COMMIT='../../etc' ignored" in capsys.readouterr().err


def test_write_record_replaces_the_file_whole(tmp_path, monkeypatch):
    """A write that dies part-way (here: before its rename) leaves the previous record readable."""
    path = tmp_path / "r.json"
    write_record({"step": 1}, path)

    def killed(src, dst):
        raise RuntimeError("killed before the rename")

    monkeypatch.setattr(report, "os", SimpleNamespace(replace=killed))
    with pytest.raises(RuntimeError, match="killed"):
        write_record({"step": 2, "more": list(range(1000))}, path)
    assert json.loads(path.read_text()) == {"step": 1}
    monkeypatch.undo()
    write_record({"step": 3}, path)
    assert json.loads(path.read_text()) == {"step": 3} and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
