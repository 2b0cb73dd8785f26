"""Two GRPO runs at ``rollout.max_in_flight = 8`` with ``rollout.deterministic = true`` roll out the same
tokens with the same logprobs and end with bitwise-equal weights, although which trajectories shared a
generation batch followed thread timing in each.

The policy samples part of every turn through the local engine's batching queue (``SampledThoughts``),
and whether it answers right depends on what it sampled, so rewards, advantages and the update all
depend on the batched generation. Without the mode, a request's logprobs depend on the batch it
lands in (4.8e-7 on the machine this was written on), and the two runs' weights differ.
"""

from __future__ import annotations

import pytest
import torch

from osvl.config import load_recipe
from osvl.model import read_hf_tensors
from osvl.rollout import RolloutRecorder
from osvl.trainer import read_metrics, run_grpo
from tests.trainer.grpo_fixtures import SampledThoughts, echo_environment
from tests.trainer.test_grpo import grpo_overrides

pytestmark = pytest.mark.slow

DETERMINISTIC = [
    "rollout.deterministic=true",
    "rollout.max_in_flight=8",
    "grpo.max_steps=2",
    "tools.fault_rate=0.0",
    "rollout.trajectory_deadline_s=3600",
]  # no deadline reachable by CPU load


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_deterministic")
    engines = []

    def sampled(local):
        engines.append(local)
        return SampledThoughts(local)

    for name in ("a", "b"):
        result = run_grpo(
            load_recipe("tiny_grpo", grpo_overrides(root, root / name, *DETERMINISTIC)),
            environment=echo_environment,
            engine_wrapper=sampled,
        )
        assert result.steps == 2
    return root / "a", root / "b", engines


def _rollouts(run, step):
    return [
        (t.group_id, t.sample_index, t.reward.total, tuple((tuple(s.token_ids), tuple(s.logprobs)) for s in t.steps))
        for t in RolloutRecorder(run / "rollouts").read(step)
    ]


def test_generation_was_batched(runs):
    *_, engines = runs
    assert len(engines) == 2 and all(e.deterministic for e in engines)
    assert all(max(e.batch_sizes) > 1 for e in engines), [e.batch_sizes for e in engines]


def test_rewards_depend_on_what_was_sampled(runs):
    a, *_ = runs
    for m in read_metrics(a):
        assert 0 < m["accuracy"] < 1, m  # some right, some wrong: the update depends on the rollouts


def test_rollouts_are_identical(runs):
    a, b, _ = runs
    for step in (1, 2):
        first, second = _rollouts(a, step), _rollouts(b, step)
        assert len(first) == 16
        assert first == second, f"step {step}"


def test_weights_are_bitwise_equal(runs):
    a, b, _ = runs
    first, second = read_hf_tensors(a / "hf"), read_hf_tensors(b / "hf")
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
