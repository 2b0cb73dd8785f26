"""A killed (-9) asynchronous GRPO run (``rollout.max_staleness = 1``, local form: the generator rolls
out on its own thread with its own engine copy while the trainer trains) resumes from its last
checkpoint with the replay buffer as it was: the groups that were scored and waiting are trained on
as they were generated (same ids, logprobs, versions, rewards: never rolled out again), the tickets
that were drawn but not done are rolled out again, and every step stays within the bound.

Bitwise equality with an uninterrupted run is not the bar here, as it is for the synchronous run
(``test_grpo_resume``): which groups a step takes depends on which finished first, so two
uninterrupted asynchronous runs differ too. What must be exact is the state the run resumes from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from osvl.rollout import RolloutRecorder
from osvl.trainer import read_metrics
from osvl.trainer.checkpoint import latest_checkpoint
from tests.trainer.test_grpo import grpo_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS, UPDATES = 4, 2
ASYNC = [
    f"grpo.max_steps={STEPS}",
    "checkpoint.every_steps=1",
    "rollout.max_staleness=1",
    "tools.fault_rate=0.3",
    "rollout.max_in_flight=4",
    "rollout.trajectory_deadline_s=3600",
]


def _launch(overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.trainer.grpo_job", json.dumps(overrides)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _record(t) -> tuple:
    return (
        t.prompt.id,
        t.sample_index,
        t.fatal_step,
        t.reward.total,
        tuple(
            (tuple(s.token_ids), tuple(s.logprobs), tuple(s.versions), tuple(s.observation_token_ids)) for s in t.steps
        ),
    )


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_resume")
    run = root / "run"
    overrides = grpo_overrides(root, run, *ASYNC)
    first = _launch(overrides)
    marker = run / "checkpoints" / "step_00000002" / "complete"
    deadline = time.monotonic() + 900
    while not marker.is_file():
        assert first.poll() is None, f"the run ended before its step-2 checkpoint:\n{first.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 900 s"
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGKILL)  # during step 3
    first.wait(60)
    checkpoint = latest_checkpoint(run / "checkpoints")
    state = torch.load(checkpoint / "trainer_rank0.pt", weights_only=False)
    second = _launch(overrides)
    out, _ = second.communicate(timeout=1200)
    assert second.returncode == 0, out[-4000:]
    return run, first.returncode, int(checkpoint.name.removeprefix("step_")), state, out


def test_the_run_was_killed_and_the_relaunch_finished(killed_and_resumed):
    run, killed, resumed_at, state, out = killed_and_resumed
    assert killed == -signal.SIGKILL
    assert f"steps {STEPS} resumed from {resumed_at}" in out
    assert state["policy_version"] == UPDATES * resumed_at == state["replay"]["version"]
    final = {m["step"]: m for m in read_metrics(run)}
    assert final[STEPS]["policy_version"] == UPDATES * STEPS


def test_the_waiting_groups_are_trained_on_as_they_were_generated(killed_and_resumed):
    run, _, resumed_at, state, _ = killed_and_resumed
    buffered = [t for _, trajectories in state["replay"]["buffer"]["groups"] for t in trajectories]
    pending = state["replay"]["pending"]
    assert buffered and pending  # groups rolled out ahead and waiting, and tickets drawn ahead
    assert any(min(s.policy_version for s in t.steps) < UPDATES * resumed_at for t in buffered if t.steps)
    recorder = RolloutRecorder(run / "rollouts")
    resumed = {_record(t) for step in range(resumed_at + 1, STEPS + 1) for t in recorder.read(step)}
    missing = [t.prompt.id for t in buffered if _record(t) not in resumed]
    assert not missing, f"buffered groups not trained on as they were: {missing}"


def test_every_step_before_and_after_the_kill_is_within_the_bound(killed_and_resumed):
    run, _, _, _, _ = killed_and_resumed
    recorder = RolloutRecorder(run / "rollouts")
    lags = []
    for step in range(1, STEPS + 1):
        trained_from = UPDATES * (step - 1)
        for t in recorder.read(step):
            if t.steps:
                lag = (trained_from - min(min(s.versions) for s in t.steps)) / UPDATES
                assert 0 <= lag <= 1, (step, t.prompt.id)
                lags.append(lag)
    assert 1 in lags
