"""A resumed GRPO run is the uninterrupted one: same rollouts (ids, logprobs, injected tool faults),
same metrics, bitwise-equal final weights, and the same final trainer state with every RNG in it.

Both runs use one process (the 2-rank path is covered by test_grpo), the scripted policy (real
logprobs) and deterministic echo tools with injected faults. Run A takes 3 steps straight; run B
takes 3 with a checkpoint at step 2 and "dies while saving step 3" (its checkpoint's completion
marker removed), so step 3's metrics and rollouts outlive the checkpoint it resumes from; the
relaunch must discard them and record step 3 once, as run A did. Bitwise equality is the right bar:
the same ops run on the same inputs in the same order on the same machine, so any difference means
some piece of state (weights, Adam moments, lr schedule, cursor, policy version, fault seed) was not
restored, or that something in the rollout depends on the order concurrent trajectories finish in.
No deadline may be reachable by CPU load: a call or trajectory that times out rolls out differently,
so the deadlines here are generous and a test asserts none was hit. Run C is run B's fault as an
operator meets it: the run's process killed (-9) during step 3 and launched again."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch

from osvl.config import load_recipe
from osvl.model import read_hf_tensors
from osvl.rl.trajectory import FinishReason, ToolStatus
from osvl.rollout import RolloutRecorder
from osvl.tools import PoolConfig, ToolBackendsConfig, ToolEnvironment, ToolPool, ToolRegistry
from osvl.trainer import read_metrics, run_grpo
from osvl.trainer.tool_env import with_faults
from tests.fresh_imports import fresh_imports
from tests.trainer.grpo_fixtures import scripted
from tests.trainer.resume_fixtures import deterministic_specs
from tests.trainer.test_grpo import grpo_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# Several trajectories in flight: tool calls finish in an order set by thread timing, and the runs
# must still match, since a fault is decided by the call's identity, not by when it finishes.
RESUME = [
    "grpo.max_steps=3",
    "tools.fault_rate=0.3",
    "checkpoint.every_steps=2",
    "rollout.max_in_flight=4",
    "rollout.trajectory_deadline_s=3600",
]


@contextmanager
def deterministic_environment(recipe, rank):
    """Echo tools whose output depends only on the call, imported before the worker takes a call."""
    registry = ToolRegistry(deterministic_specs())
    config = PoolConfig(num_workers=1, max_queue=16, watch_interval_s=0.02, preload=registry.targets())
    with ToolPool(ToolBackendsConfig(), config) as pool:
        yield with_faults(ToolEnvironment(registry, pool), recipe, rank)


def _run(overrides, stop_after=None):
    return run_grpo(
        load_recipe("tiny_grpo", overrides),
        stop_after=stop_after,
        environment=deterministic_environment,
        engine_wrapper=scripted,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_resume")
    overrides_a, overrides_b = grpo_overrides(root, root / "a", *RESUME), grpo_overrides(root, root / "b", *RESUME)

    a = _run(overrides_a)
    assert a.steps == 3 and a.resumed_from == 0, a
    first = _run(overrides_b)
    assert first.steps == 3, first
    (root / "b" / "checkpoints" / "step_00000003" / "complete").unlink()  # killed while saving step 3
    relaunch = io.StringIO()
    with redirect_stdout(relaunch):
        second = _run(overrides_b)
    assert second.steps == 3 and second.resumed_from == 2, second
    return root / "a", root / "b", relaunch.getvalue().splitlines()


def _rollout_record(trajectory) -> tuple:
    steps = tuple(
        (
            tuple(s.token_ids),
            tuple(s.logprobs),
            tuple(s.observation_token_ids),
            None if s.tool_result is None else (s.tool_result.status, s.tool_result.error),
        )
        for s in trajectory.steps
    )
    return trajectory.group_id, trajectory.sample_index, trajectory.fatal_step, trajectory.reward.total, steps


def test_relaunch_says_what_it_resumed_and_discarded(runs):
    _, b, lines = runs
    assert lines[0] == (
        f"resume: {b}/checkpoints/step_00000002 at step 2 of 3 (policy version 4); discarded after "
        "step 2: metrics of steps 3; rollouts of steps 3; checkpoints step_00000003"
    )


def test_resumed_rollouts_match(runs):
    a, b, _ = runs
    injected = 0
    for step in (1, 2, 3):
        straight = [_rollout_record(t) for t in RolloutRecorder(a / "rollouts").read(step)]
        resumed = [_rollout_record(t) for t in RolloutRecorder(b / "rollouts").read(step)]
        assert len(straight) == 16 and len(resumed) == 16  # the re-run step 3 is recorded once
        assert resumed == straight, f"step {step}: the resumed run rolled out something else"
        injected += sum(1 for t in straight for s in t[4] if s[3] is not None and s[3][1] == "injected fault")
    assert injected > 0  # faults were injected, so their reproduction is part of what the equality checks


def test_no_deadline_was_hit(runs):
    """A timeout is the one legitimate way for the two runs to differ; it must not have happened."""
    for run in runs[:2]:
        for step in (1, 2, 3):
            for t in RolloutRecorder(run / "rollouts").read(step):
                where = f"{run.name} step {step} group {t.group_id} sample {t.sample_index}"
                assert t.finish_reason is not FinishReason.INFRA_ERROR, (
                    f"{where}: trajectory deadline or engine failure"
                )
                for s in t.steps:
                    if s.tool_result is not None:
                        assert s.tool_result.status not in (ToolStatus.TIMEOUT, ToolStatus.INFRA_ERROR), (
                            f"{where}: {s.tool_result.error}"
                        )


def test_tool_module_is_cheap_for_the_worker():
    """Every worker start (and restart after a timeout) imports the preloaded targets: the fixture
    module must not pull in torch, whose import (with the trainer's) took over 30 s on a loaded 2-core machine."""
    code = (
        "import osvl.tools.worker as w\n"
        "from tests.trainer.resume_fixtures import deterministic_specs\n"
        "assert not w.preload_targets(s.target for s in deterministic_specs())"
    )
    assert fresh_imports(code, ("torch", "osvl.trainer")) == []


def test_resumed_weights_are_bitwise_equal(runs):
    a, b, _ = runs
    straight, resumed = read_hf_tensors(a / "hf"), read_hf_tensors(b / "hf")
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key


def test_resumed_metrics_continue_the_stream(runs):
    a, b, _ = runs
    straight = read_metrics(a)
    written = [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in straight] == [1, 2, 3] and written == [1, 2, 3]  # each step once in the file
    resumed = {m["step"]: m for m in read_metrics(b)}
    for m in straight:
        r = resumed[m["step"]]
        for key in (
            "loss",
            "lr",
            "policy_version",
            "reward",
            "accuracy",
            "fatal",
            "clamped",
            "train_tokens",
            "model_tflops",
            "rollout_tflops",
        ):
            assert r[key] == m[key], (m["step"], key, r[key], m[key])
        assert m["model_tflops"] > 0 and m["rollout_tflops"] > 0
        assert "mfu" not in m  # CPU: no peak in the table, so no MFU rather than a made-up one
    assert [m["policy_version"] for m in straight] == [2, 4, 6]


def _job(overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}
    command = [sys.executable, "-m", "tests.trainer.grpo_job", json.dumps(overrides)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def killed_and_relaunched(runs):
    """Run C in processes of its own: killed (-9) once its step-2 checkpoint is complete, then relaunched."""
    a = runs[0]
    c = a.parent / "c"
    overrides = grpo_overrides(a.parent, c, *RESUME)
    first = _job(overrides)
    marker = c / "checkpoints" / "step_00000002" / "complete"
    deadline = time.monotonic() + 900
    while not marker.is_file():
        assert first.poll() is None, f"the run ended before its step-2 checkpoint:\n{first.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no step-2 checkpoint within 900 s"
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(60)
    second = _job(overrides)
    out, _ = second.communicate(timeout=1200)
    assert second.returncode == 0, out[-4000:]
    assert "steps 3 resumed from 2" in out, out[-4000:]  # the kill landed during step 3
    return a, c


def _final_state(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "step_00000003" / "trainer_rank0.pt", weights_only=False)


def test_a_killed_and_relaunched_run_ends_in_the_uninterrupted_runs_state(killed_and_relaunched):
    """Weights, optimizer schedule, data cursor, policy version and every random generator: anything
    the relaunch draws at start-up (its generation copy of the policy, its pre-flight) must come before
    the checkpoint's generators are restored, or a later draw would diverge."""
    a, c = killed_and_relaunched
    straight, relaunched = _final_state(a), _final_state(c)
    rng_a, rng_c = straight.pop("rng"), relaunched.pop("rng")
    assert set(rng_a) == set(rng_c) == {"torch", "numpy", "python"}
    assert torch.equal(rng_a["torch"], rng_c["torch"]), "torch's generator was not where the straight run left it"
    assert rng_a["python"] == rng_c["python"]
    assert rng_a["numpy"][0] == rng_c["numpy"][0] and np.array_equal(rng_a["numpy"][1], rng_c["numpy"][1])
    assert rng_a["numpy"][2:] == rng_c["numpy"][2:]
    assert relaunched == straight
    weights_a, weights_c = read_hf_tensors(a / "hf"), read_hf_tensors(c / "hf")
    assert weights_a.keys() == weights_c.keys()
    assert all(torch.equal(weights_a[k], weights_c[k]) for k in weights_a)
