"""``osvl.report`` renders real PNGs from metrics.jsonl; the demo summary reads runs."""

from __future__ import annotations

import pytest

from osvl.demo import summary_lines
from osvl.report import main as report_main
from osvl.report import render
from osvl.trainer.metrics import MetricsWriter

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(path, mode: str, accuracy: list[float]):
    writer = MetricsWriter(path, enabled=True, tensorboard=False, console=False, header={"grpo": {"fatal_mode": mode}})
    for step, acc in enumerate(accuracy, 1):
        writer.log(
            step,
            len(accuracy),
            {
                "loss": 1.0 / step,
                "reward": acc * 0.8,
                "accuracy": acc,
                "grounded": 1.0 - acc,
                "fatal_rate": 0.5 / step,
                "clamped_frac": 0.9,
                "time_train_s": 0.1,
                "time_rollout_s": 0.2,
            },
        )
    return path


def test_render_writes_a_png_per_logged_panel(tmp_path):
    run = fake_run(tmp_path / "run", "fatal_clamp", [0.1, 0.2, 0.4])
    paths = render(run)
    names = sorted(p.name for p in paths)
    assert names == ["accuracy.png", "fatal.png", "loss.png", "reward.png", "step_time.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 2000


def test_report_cli_and_errors(tmp_path, capsys):
    run = fake_run(tmp_path / "run", "vanilla", [0.0, 0.5])
    assert report_main([str(run), "--out", str(tmp_path / "plots")]) == 0
    assert "accuracy.png" in capsys.readouterr().out and (tmp_path / "plots" / "loss.png").is_file()
    with pytest.raises(SystemExit):
        report_main([str(tmp_path / "missing")])
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        render(tmp_path / "empty")


def test_summary_reports_before_and_after_honestly(tmp_path):
    sft = fake_run(tmp_path / "sft", "fatal_clamp", [0.0, 0.0])
    up = summary_lines(sft, fake_run(tmp_path / "up", "fatal_clamp", [0.1, 0.3]))
    assert f"{'accuracy':<22} before 0.100  after 0.300" in "\n".join(up) and "accuracy improved" in up[-2]
    assert f"{'grounded':<22} before 0.900  after 0.700" in "\n".join(up)  # the share of answers read from a tool
    assert not any("signal_groups" in line for line in up)  # a run that did not log them
    down = summary_lines(sft, fake_run(tmp_path / "down", "fatal_clamp", [0.5, 0.25]))
    assert "did NOT improve" in down[-2]
