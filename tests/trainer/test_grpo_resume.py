"""A resumed GRPO run is the uninterrupted one: same rollouts (ids, logprobs, injected tool faults),
same metrics, bitwise-equal final weights.

Both runs use one process (the 2-rank path is covered by test_grpo), the scripted policy (real logprobs) and deterministic echo tools with
injected faults. Run A takes 3 steps straight; run B takes 2, "crashes", and resumes to 3. Bitwise equality
is the right bar: the same ops run on the same inputs in the same order on the same machine, so any
difference means some piece of state (weights, Adam moments, lr schedule, cursor, policy version,
fault RNG) was not restored.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from osvl.config import load_recipe
from osvl.rollout import RolloutRecorder
from osvl.trainer import read_metrics, run_grpo
from tests.trainer.grpo_fixtures import scripted
from tests.trainer.resume_fixtures import deterministic_environment
from tests.trainer.test_grpo import grpo_overrides

# One trajectory in flight: fault draws follow tool-call order, which concurrent rollouts make
# depend on thread timing (see step_faults); sequential rollouts make that order reproducible.
RESUME = ["grpo.max_steps=3", "tools.fault_rate=0.3", "checkpoint.every_steps=0", "rollout.max_in_flight=1"]


def _run(overrides, stop_after=None):
    return run_grpo(load_recipe("tiny_grpo", overrides), stop_after=stop_after,
                    environment=deterministic_environment, engine_wrapper=scripted)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_resume")
    overrides_a, overrides_b = grpo_overrides(root, root / "a", *RESUME), grpo_overrides(root, root / "b", *RESUME)

    a = _run(overrides_a)
    assert a.steps == 3 and a.resumed_from == 0, a
    first = _run(overrides_b, stop_after=2)
    assert first.steps == 2, first
    second = _run(overrides_b)
    assert second.steps == 3 and second.resumed_from == 2, second
    return root / "a", root / "b"


def _rollout_record(trajectory) -> tuple:
    steps = tuple((tuple(s.token_ids), tuple(s.logprobs), tuple(s.observation_token_ids),
                   None if s.tool_result is None else (s.tool_result.status, s.tool_result.error))
                  for s in trajectory.steps)
    return trajectory.group_id, trajectory.sample_index, trajectory.fatal_step, trajectory.reward.total, steps


def test_resumed_rollouts_match(runs):
    a, b = runs
    injected = 0
    for step in (1, 2, 3):
        straight = [_rollout_record(t) for t in RolloutRecorder(a / "rollouts").read(step)]
        resumed = [_rollout_record(t) for t in RolloutRecorder(b / "rollouts").read(step)]
        assert len(straight) == 16
        assert resumed == straight, f"step {step}: the resumed run rolled out something else"
        injected += sum(1 for t in straight for s in t[4] if s[3] is not None and s[3][1] == "injected fault")
    assert injected > 0  # the fault RNG was exercised, so its resumption is what the equality checks


def test_resumed_weights_are_bitwise_equal(runs):
    a, b = runs
    straight, resumed = load_file(str(a / "hf" / "model.safetensors")), load_file(str(b / "hf" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(resumed[key], straight[key]), key


def test_resumed_metrics_continue_the_stream(runs):
    a, b = runs
    straight = read_metrics(a)
    resumed = {m["step"]: m for m in read_metrics(b)}
    assert [m["step"] for m in straight] == [1, 2, 3] and sorted(resumed) == [1, 2, 3]
    for m in straight:
        r = resumed[m["step"]]
        for key in ("loss", "lr", "policy_version", "reward", "accuracy", "fatal", "clamped", "train_tokens",
                    "model_tflops", "rollout_tflops"):
            assert r[key] == m[key], (m["step"], key, r[key], m[key])
        assert m["model_tflops"] > 0 and m["rollout_tflops"] > 0
        assert "mfu" not in m  # CPU: no peak in the table, so no MFU rather than a made-up one
    assert [m["policy_version"] for m in straight] == [2, 4, 6]


def test_fault_draws_depend_on_step_not_history():
    from types import SimpleNamespace

    from osvl.tools import ToolEnvironment
    from osvl.trainer.grpo import step_faults
    from osvl.trainer.tool_env import FaultInjectingRunner

    env = ToolEnvironment(registry=None, pool=FaultInjectingRunner(SimpleNamespace(), 0.5, seed=0))
    draws = lambda e: [e.pool._rng.random() for _ in range(8)]
    first = draws(step_faults(env, seed=0, step=3, rank=0))
    assert draws(step_faults(env, seed=0, step=3, rank=0)) == first  # a resumed run at step 3 draws the same
    assert draws(step_faults(env, seed=0, step=4, rank=0)) != first
    assert draws(step_faults(env, seed=0, step=3, rank=1)) != first
    plain = ToolEnvironment(registry=None, pool=SimpleNamespace())
    assert step_faults(plain, seed=0, step=3, rank=0) is plain  # no faults configured: untouched
