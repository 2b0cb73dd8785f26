"""A relaunch cuts every per-run record back to the checkpoint it resumes from: metrics (what the
report plots), TensorBoard events, rollouts and checkpoints; readers take the last attempt of a step."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from osvl.config import load_recipe
from osvl.rl.trajectory import FinishReason, Prompt, Trajectory
from osvl.rollout import RolloutRecorder
from osvl.trainer.checkpoint import MARKER, discard_checkpoints_after
from osvl.trainer.metrics import MetricsWriter, read_metrics, truncate_metrics, truncate_tensorboard
from osvl.trainer.resume import Discarded, Resumption, discard_records_after, recorded_loss, resume_records, step_ranges
from osvl.trainer.rng import seed_generators


def _log(run_dir, steps, loss=lambda s: 1.0 / s, tensorboard=False):
    writer = MetricsWriter(run_dir, enabled=True, tensorboard=tensorboard, console=False)
    for step in steps:
        writer.log(step, 10, {"loss": loss(step), "lr": 0.1})
    writer.close()


def _trajectories(n: int, tag: str) -> list[Trajectory]:
    return [
        Trajectory(Prompt(id=f"{tag}{i}", question="q", answer="a"), [], FinishReason.MAX_TURNS, i, 0) for i in range(n)
    ]


def test_step_ranges():
    assert step_ranges([9, 5, 6, 7, 7, 12, 13]) == "5-7, 9, 12-13"
    assert step_ranges([]) == ""


def test_metrics_are_cut_back_and_a_torn_line_is_dropped(tmp_path):
    _log(tmp_path, range(1, 8))
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 8, "lo')  # killed mid-write
    assert truncate_metrics(tmp_path, 4) == ([5, 6, 7], 1)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert truncate_metrics(tmp_path, 4) == ([], 0)  # nothing more to cut
    assert truncate_metrics(tmp_path / "none", 4) == ([], 0)


def test_readers_take_the_last_attempt_of_a_step(tmp_path):
    """A file written before resumes truncated: steps 1-6, then a relaunch from checkpoint 4."""
    _log(tmp_path, range(1, 7), loss=lambda s: 1.0)
    _log(tmp_path, range(5, 9), loss=lambda s: 2.0)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["loss"] for r in records] == [1.0] * 4 + [2.0] * 4
    assert recorded_loss(tmp_path, 8) == 2.0 and math.isnan(recorded_loss(tmp_path, 9))
    assert math.isnan(recorded_loss(tmp_path / "none", 1))


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=False)
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars("loss")]


def test_tensorboard_events_are_cut_back(tmp_path):
    pytest.importorskip("tensorboard")
    _log(tmp_path, range(1, 7), tensorboard=True)
    event_file = next((tmp_path / "tensorboard").iterdir())
    with open(event_file, "ab") as handle:
        handle.write(b"\x10\x00\x00")  # a record torn by the kill
    event_file.with_name(event_file.name + ".tmp").write_bytes(b"half")  # a rewrite cut short
    assert truncate_tensorboard(tmp_path, 3) == 2 * 3  # loss and lr of steps 4-6
    assert [p.name for p in (tmp_path / "tensorboard").iterdir()] == [event_file.name]
    _log(tmp_path, range(4, 6), loss=lambda s: 7.0, tensorboard=True)  # the relaunch
    assert _scalars(tmp_path) == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 7.0), (5, 7.0)]
    assert truncate_tensorboard(tmp_path, 10) == 0 and truncate_tensorboard(tmp_path / "none", 0) == 0


def test_recorder_replaces_a_step_and_discards_later_ones(tmp_path):
    recorder = RolloutRecorder(tmp_path)
    for step in (1, 2, 3):
        recorder.write(step, _trajectories(2, f"first{step}-"))
    assert recorder.write(2, _trajectories(3, "again")) == 3  # step 2 runs again after a resume
    assert [t.prompt.id for t in recorder.read(2)] == ["again0", "again1", "again2"]
    (tmp_path / "rollouts_step000004.jsonl.tmp").write_text("half")  # killed mid-write
    assert recorder.steps() == [1, 2, 3]
    assert recorder.discard_after(1) == [2, 3]
    assert recorder.steps() == [1] and not list(tmp_path.glob("*.tmp"))
    assert RolloutRecorder(tmp_path / "none").discard_after(0) == []


def test_incomplete_and_later_checkpoints_are_discarded(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False), (8, True)):
        (tmp_path / f"step_{step:08d}").mkdir()
        if complete:
            (tmp_path / f"step_{step:08d}" / MARKER).write_text(str(step))
    (tmp_path / "step_notanumber").mkdir()
    assert discard_checkpoints_after(tmp_path, 4) == ["step_00000006", "step_00000008"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000004", "step_notanumber"]


def test_discard_records_after_reports_everything_it_cut(tmp_path):
    _log(tmp_path, range(1, 6))
    RolloutRecorder(tmp_path / "rollouts").write(5, _trajectories(1, "x"))
    (tmp_path / "checkpoints" / "step_00000005").mkdir(parents=True)
    discarded = discard_records_after(tmp_path, 3)
    assert discarded == Discarded(metrics_steps=(4, 5), rollout_steps=(5,), checkpoints=("step_00000005",))
    assert discarded.describe() == "metrics of steps 4-5; rollouts of steps 5; checkpoints step_00000005"
    assert discard_records_after(tmp_path, 3).describe() == "nothing"


def test_resumption_lines(tmp_path):
    base = dict(
        run_dir=tmp_path, policy_version=8, total=10, discarded=Discarded(metrics_steps=(5, 6)), final_loss=0.25
    )
    resumed = Resumption(checkpoint=tmp_path / "checkpoints/step_00000004", step=4, **base)
    assert resumed.line() == (
        f"resume: {tmp_path}/checkpoints/step_00000004 at step 4 of 10 (policy version 8); "
        "discarded after step 4: metrics of steps 5-6"
    )
    done = Resumption(checkpoint=tmp_path / "c", step=10, **base)
    assert done.finished and "nothing left to train; recorded final loss 0.2500" in done.line()
    fresh = Resumption(checkpoint=None, step=0, **base)
    assert not fresh.finished and fresh.line().startswith(f"start: {tmp_path} from step 0 of 10 (no checkpoint)")


def test_resume_records_on_rank_0_only(tmp_path, capsys):
    recipe = load_recipe("tiny_sft", [f"job.run_dir={tmp_path}"])
    _log(tmp_path, range(1, 6))
    state = {"step": 3, "checkpoint": str(tmp_path / "checkpoints" / "step_00000003")}
    other = resume_records(recipe, 1, state, 10)
    assert other.discarded == Discarded() and capsys.readouterr().out == ""
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]  # untouched by rank 1
    first = resume_records(recipe, 0, state, 10)
    assert first.final_loss == pytest.approx(1 / 3) and first.policy_version == 3  # SFT: a step is an update
    assert capsys.readouterr().out.splitlines() == [first.line()]
    assert "metrics of steps 4-5" in first.line()


def test_all_generators_are_seeded_from_the_job_seed():
    draws = []
    for _ in range(2):
        seed_generators(11)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
    assert draws[0] == draws[1]
    seed_generators(12)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) != draws[0]
