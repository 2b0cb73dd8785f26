import asyncio
import functools

import pytest
import torch

from bench.rollout.worker_pool import RolloutWorkerPool, WorkerPoolConfig
from osvl.rl.trajectory import FinishReason
from osvl.rollout.workers import RolloutMetrics, stream_groups
from tests.bench.rollout import factories
from tests.rollout.helpers import prompts
from tests.rollout.scripts import call, respond

TURNS = [call("echo_image", image=0, tag="w"), respond()]


def _by_key(groups):
    return {(g.prompt.id, t.sample_index): t for g in groups for t in g.trajectories}


def test_side_process_groups_match_in_process_rollouts_with_weights_and_back_pressure(tmp_path):
    config = WorkerPoolConfig(num_workers=2, groups_per_worker=1, weights_dir=str(tmp_path))
    batch = prompts(4)
    local = factories.rollout_setup(TURNS)
    with RolloutWorkerPool(functools.partial(factories.rollout_setup, TURNS), config) as pool:
        assert len(set(pool.worker_pids)) == 2
        metrics = RolloutMetrics()
        groups = []
        for group in pool.stream(batch, step=0, metrics=metrics):
            assert pool.groups_in_flight <= 2  # credits: one group per worker, never more
            groups.append(group)
        assert sorted(g.group_id for g in groups) == [0, 1, 2, 3]
        assert metrics.trajectories == 8 and metrics.tool_calls == {"echo_image": 8}

        async def in_process():
            return [
                g
                async for g in stream_groups(batch, local.engine, local.env, local.renderer, local.agent, local.rollout)
            ]

        want = _by_key(asyncio.run(in_process()))
        for key, traj in _by_key(groups).items():  # the same ids and (to fp32 noise) logprobs as in-process
            assert traj.finish_reason is FinishReason.RESPONSE and len(traj.steps) == 2
            # the tool ran in a worker process (the echo names its pid), not in the caller's
            assert int(traj.steps[0].observation_text.rsplit("pid=", 1)[1].split()[0]) in pool.worker_pids
            assert [s.token_ids for s in traj.steps] == [s.token_ids for s in want[key].steps]
            assert traj.steps[0].logprobs == pytest.approx(want[key].steps[0].logprobs, abs=1e-5)

        generator = torch.Generator().manual_seed(3)
        update = {
            k: v + 0.3 * torch.randn(v.shape, generator=generator)
            for k, v in local.engine.inner.engine.model.state_dict().items()
        }
        pool.load_weights(update, 5)
        with pytest.raises(ValueError, match="rejected weights"):
            pool.load_weights({"not.a.weight": torch.zeros(1)}, 6)
        updated = _by_key(pool.stream(batch[:1], step=1))
        local.engine.load_weights(update, 5)
        want = _by_key(asyncio.run(in_process()))
        for key, traj in updated.items():
            assert all(step.policy_version == 5 for step in traj.steps)
            assert traj.steps[0].logprobs == pytest.approx(want[key].steps[0].logprobs, abs=1e-5)
            assert traj.steps[0].logprobs != pytest.approx(groups[0].trajectories[0].steps[0].logprobs, abs=1e-3)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode, retries", [("crash", 1), ("crash", 0), ("freeze", 1)])
def test_a_dead_or_stuck_worker_is_replaced_and_its_group_retried_or_dropped(tmp_path, mode, retries):
    flag = tmp_path / "died"
    factory = functools.partial(factories.rollout_setup, TURNS, "? (1)", str(flag), mode)
    # one group per worker: the dying worker holds exactly the group of p1
    config = WorkerPoolConfig(
        num_workers=2,
        groups_per_worker=1,
        max_group_retries=retries,
        group_deadline_s=4.0 if mode == "freeze" else 600.0,
    )
    with RolloutWorkerPool(factory, config) as pool:
        before = set(pool.worker_pids)
        metrics = RolloutMetrics()
        groups = list(pool.stream(prompts(4), metrics=metrics))
        assert flag.exists() and len(set(pool.worker_pids) - before) == 1  # one worker replaced
        assert pool.stats.deaths == 1 and pool.stats.deadline_kills == (mode == "freeze")
        assert sorted(g.group_id for g in groups) == [0, 1, 2, 3]
        trajectories = _by_key(groups)
        lost = trajectories[("p1", 0)], trajectories[("p1", 1)]
        if retries:
            assert pool.stats.group_retries == 1 and metrics.dropped == 0
            assert all(t.finish_reason is FinishReason.RESPONSE for t in lost)
        else:
            assert pool.stats.groups_dropped == 1 and metrics.dropped == 2
            assert all(t.finish_reason is FinishReason.INFRA_ERROR and not t.steps for t in lost)
        others = [t for (prompt_id, _), t in trajectories.items() if prompt_id != "p1"]
        assert len(others) == 6 and all(t.finish_reason is FinishReason.RESPONSE for t in others)
        again = list(pool.stream(prompts(2)))  # the replacement serves the next stream
        assert all(t.finish_reason is FinishReason.RESPONSE for g in again for t in g.trajectories)


def test_pool_rejects_bad_configs_and_factories():
    for kwargs, message in [
        ({"num_workers": 0}, "num_workers"),
        ({"group_deadline_s": 0}, "group_deadline_s"),
        ({"max_group_retries": -1}, "max_group_retries"),
        ({"start_method": "x"}, "start_method"),
    ]:
        with pytest.raises(ValueError, match=message):
            WorkerPoolConfig(**kwargs)
    with pytest.raises(RuntimeError, match="failed to start: ValueError: no model here"):
        RolloutWorkerPool(factories.broken_engine, WorkerPoolConfig(num_workers=1))
