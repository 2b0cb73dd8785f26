"""bench/device_summary.py: the return limits of the GPU machine's $OUT, and a summary that survives a
result JSON it cannot read."""

import json
import os

from bench.device_summary import ReturnLimits, main, return_problems, write_summary


def touch(path, size=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the size without the disk


def test_a_device_check_out_dir_is_within_the_limits(tmp_path):
    for name in ("device_logits-h200-abc.json", "device_linear-h200-abc.json", "device_train_step-h200-abc.json"):
        touch(tmp_path / name, 4096)
    for name in ("run.log", "stages.jsonl"):
        touch(tmp_path / "device_check" / name, 15 * 2**20)
    planned = [tmp_path / "device_check" / "summary.json", tmp_path / "device_check" / "summary.md"]
    assert return_problems(tmp_path, planned) == []
    touch(tmp_path / "device_check" / "gpu_tests.log")  # the eighth file: still comes back
    assert return_problems(tmp_path, planned) == []
    touch(tmp_path / "device_check" / "linear.log")  # the ninth
    [problem] = return_problems(tmp_path, planned)
    assert problem.startswith("9 files, only 8 come back") and "device_check/linear.log" in problem


def test_every_way_a_file_would_not_come_back(tmp_path):
    touch(tmp_path / "a" / "b" / "c" / "deep.json")
    touch(tmp_path / "a" / "odd name.log")
    touch(tmp_path / "big.log", 16 * 2**20 + 1)
    os.symlink(tmp_path / "big.log", tmp_path / "link.log")
    problems = return_problems(tmp_path, [], ReturnLimits(total_bytes=32 * 2**20))
    assert problems == [
        "a/b/c/deep.json: 3 folders down, at most 2",
        "a/odd name.log: names may hold only letters, digits, '.', '_' and '-'",
        f"big.log: {16 * 2**20 + 1} bytes, at most {16 * 2**20}",
        "link.log: a link, and links do not come back",
        f"link.log: {16 * 2**20 + 1} bytes, at most {16 * 2**20}",
        f"{2 * (16 * 2**20 + 1)} bytes in all, at most {32 * 2**20}",
    ]


def test_summary_reads_past_a_broken_result_and_says_so(tmp_path, capsys):
    """A result cut off mid-write (as an in-place write killed by a stage limit left it) is named, the
    newest readable one is summarised, and the run fails."""
    good = {"git": {"short": "abc12345"}, "device": {"name": "NVIDIA H200", "type": "cuda"}, "cases": []}
    (tmp_path / "device_logits-h200-abc12345.json").write_text(json.dumps(good))
    broken = tmp_path / "device_logits-h200-def67890.json"
    broken.write_text('{"git": {"short": "def6')
    os.utime(broken, (os.path.getmtime(broken) + 10,) * 2)  # the newer one
    (tmp_path / "device_check").mkdir()
    (tmp_path / "device_check" / "stages.jsonl").write_text('{"stage": "logits", "rc": 0}\n')
    summary = write_summary(tmp_path, returned=True)
    [unreadable] = summary["unreadable_results"]
    assert unreadable.startswith("device_logits-h200-def67890.json: ")
    assert summary["git"] == {"short": "abc12345"} and summary["failed"] == [] and summary["return_problems"] == []
    assert main([str(tmp_path)]) == 1
    assert "unreadable result: device_logits-h200-def67890.json" in capsys.readouterr().out
