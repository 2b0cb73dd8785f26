import asyncio

import numpy as np
import pytest

from osvl.rl.trajectory import FinishReason
from osvl.rollout.agent import AgentConfig
from osvl.rollout.engine import EngineError, SamplingParams
from osvl.rollout.local_engine import ReplayEngine
from osvl.rollout.parity import logprob_parity, trajectory_logprobs
from osvl.rollout.recorder import RolloutRecorder
from osvl.rollout.workers import RolloutMetrics, RolloutWorkerConfig, stream_groups
from tests.rollout.helpers import prompts
from tests.rollout.scripts import call, respond, scripted

AGENT = AgentConfig(max_turns=4, sampling=SamplingParams(temperature=1.0, max_new_tokens=64))


async def _collect(*args, **kwargs):
    return [group async for group in stream_groups(*args, **kwargs)]


class FlakyEngine:
    """Fails (crash) or hangs on chosen samples, forwarding everything else."""

    def __init__(self, inner, crash_seeds=(), hang_seeds=()):
        self.inner, self.crash, self.hang = inner, set(crash_seeds), set(hang_seeds)

    @property
    def policy_version(self):
        return self.inner.policy_version

    async def generate(self, request):
        seed = request.sampling.seed
        if seed in self.crash:
            raise EngineError("engine worker crashed")
        if seed in self.hang:
            await asyncio.sleep(3600)
        return await self.inner.generate(request)


def test_groups_stay_together_with_faults_and_metrics(local_engine, env, renderer):
    from osvl.rollout.engine import derive_seed

    turns = [call("echo_image", image=0, tag="x"), respond()]
    base = ReplayEngine(local_engine, scripted(turns))
    crash = {derive_seed(0, "p1", 0)}  # always crashes: dropped after its retry
    hang = {derive_seed(0, "p2", 1)}  # always hangs: deadline, retry, drop
    engine = FlakyEngine(base, crash, hang)
    metrics = RolloutMetrics()
    config = RolloutWorkerConfig(group_size=2, max_in_flight=4, trajectory_deadline_s=4.0, max_retries=1, queue_size=1)
    groups = asyncio.run(_collect(prompts(3), engine, env, renderer, AGENT, config, metrics=metrics))
    assert sorted(g.group_id for g in groups) == [0, 1, 2]
    for g in groups:
        assert [t.sample_index for t in g.trajectories] == [0, 1]
        assert all(t.group_id == g.group_id and t.prompt.id == g.prompt.id for t in g.trajectories)
    by_key = {(g.prompt.id, t.sample_index): t for g in groups for t in g.trajectories}
    for key in [("p1", 0), ("p2", 1)]:
        assert by_key[key].finish_reason is FinishReason.INFRA_ERROR and by_key[key].infra_retries == 1
    ok = [t for k, t in by_key.items() if k not in {("p1", 0), ("p2", 1)}]
    assert len(ok) == 4 and all(t.finish_reason is FinishReason.RESPONSE for t in ok)
    summary = metrics.summary()
    assert metrics.trajectories == 6 and summary["dropped"] == 2 and summary["retries"] == 2
    assert summary["tool_calls"] == {"echo_image": 4} and summary["statuses"] == {"ok": 4}
    assert summary["fatal_rate"] == 0 and summary["engine_tokens_per_s"] > 0


def test_rollout_config_refuses_bad_values():
    with pytest.raises(ValueError, match="max_retries"):
        RolloutWorkerConfig(max_retries=-1)
    with pytest.raises(ValueError, match="trajectory_deadline_s"):
        RolloutWorkerConfig(trajectory_deadline_s=0)


def test_sampled_rollouts_recorded_and_logprobs_match_the_trainer(local_engine, env, renderer, tmp_path):
    turns = [call("echo_image", image=0, tag="p"), call("echo", tag="q"), respond()]
    engine = ReplayEngine(local_engine, scripted(turns))
    config = RolloutWorkerConfig(group_size=2, max_in_flight=4)
    groups = asyncio.run(_collect(prompts(2), engine, env, renderer, AGENT, config))
    trajectories = [t for g in groups for t in g.trajectories]
    recorder = RolloutRecorder(tmp_path / "run")
    assert recorder.write(3, trajectories) == 4
    replayed = recorder.read(3)
    assert [t.steps[0].token_ids for t in replayed] == [t.steps[0].token_ids for t in trajectories]
    assert all(
        np.array_equal(a.steps[0].observation_images[0], b.steps[0].observation_images[0])
        for a, b in zip(replayed, trajectories)
    )
    # the reference backend for the batch; the Triton kernel (interpreted on CPU: slow) scores one below
    report = logprob_parity(local_engine.model, renderer, replayed, backend="torch")
    assert report.tokens == sum(len(s.token_ids) for t in trajectories for s in t.steps)
    assert report.mean_abs_diff < 1e-5 and report.max_abs_diff < 1e-4
    trainer, engine_lp = trajectory_logprobs(local_engine.model, renderer, replayed[0])
    engine_lp = engine_lp.copy()
    engine_lp[0] += 0.5  # a corrupted record is caught
    assert np.abs(trainer - engine_lp).max() > 0.4
    with pytest.raises(ValueError, match="no rollouts recorded"):
        recorder.read(4)


def test_recorder_rejects_negative_steps(tmp_path):
    with pytest.raises(ValueError, match="step must be >= 0"):
        RolloutRecorder(tmp_path).path(-1)


@pytest.mark.parametrize(("errors", "infra_rollouts"), [("policy", "drop"), ("policy", "keep"), ("all", "keep")])
def test_an_outage_is_retried_or_kept_and_counted_as_the_recipe_says(
    local_engine, env, renderer, errors, infra_rollouts
):
    from osvl.rl.fatal import FatalConfig
    from osvl.tools import ToolEnvironment
    from osvl.tools.faults import FaultInjectingRunner, OutageModel

    down = OutageModel(rate=1.0, start_turns=1, tools=("echo",))  # the echo back-end is down for every rollout
    outage_env = ToolEnvironment(env.registry, FaultInjectingRunner(env.pool, 0.0, seed=1, outages=down))
    engine = ReplayEngine(local_engine, scripted([call("echo", tag="x")]))  # keeps calling
    agent = AgentConfig(max_turns=5, sampling=AGENT.sampling, fatal=FatalConfig(k=3, errors=errors))
    config = RolloutWorkerConfig(group_size=2, max_retries=1, infra_rollouts=infra_rollouts)
    metrics = RolloutMetrics()
    [group] = asyncio.run(_collect(prompts(1), engine, outage_env, renderer, agent, config, metrics=metrics))
    for traj in group.trajectories:
        assert all(s.tool_result.status.value == "infra_error" for s in traj.steps)
        assert traj.infra_retries == (1 if infra_rollouts == "drop" else 0)  # a kept outage is data, not retried
        if errors == "all":  # three consecutive failures abort the rollout at the breach
            assert traj.finish_reason is FinishReason.FATAL and len(traj.steps) == 3 and traj.fatal_step == 2
        else:  # the outage never counts: the rollout runs out of turns, fatal at its end
            assert traj.finish_reason is FinishReason.MAX_TURNS and len(traj.steps) == 5 and traj.fatal_step == 5
    assert metrics.retries == (2 if infra_rollouts == "drop" else 0)


def test_unknown_infra_rollouts_is_refused():
    with pytest.raises(ValueError, match="infra_rollouts"):
        RolloutWorkerConfig(infra_rollouts="retry")


class HeldEngine:
    """Forwards to ``inner``; while ``held``, every request waits (as a long generation would)."""

    def __init__(self, inner):
        self.inner, self.held, self.calls = inner, True, 0

    @property
    def policy_version(self):
        return self.inner.policy_version

    async def generate(self, request):
        self.calls += 1
        while self.held:
            await asyncio.sleep(0.01)
        return await self.inner.generate(request)


def test_a_weight_update_restarts_the_samples_in_flight_on_the_new_weights(env, renderer):
    from osvl.rollout.local_engine import LocalEngine
    from osvl.rollout.workers import Preemption, run_group
    from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer

    local_engine = LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG)
    engine = HeldEngine(ReplayEngine(local_engine, scripted([respond()])))
    version = local_engine.policy_version

    async def main():
        preemption, metrics = Preemption(), RolloutMetrics()
        group = asyncio.ensure_future(
            run_group(
                prompts(1)[0],
                0,
                engine,
                env,
                renderer,
                AGENT,
                RolloutWorkerConfig(group_size=3),
                metrics=metrics,
                preemption=preemption,
            )
        )
        while engine.calls < 3:  # every sample is generating on the old weights
            await asyncio.sleep(0.01)
        preemption.begin()
        await asyncio.sleep(0.05)
        assert not group.done() and engine.calls == 3  # aborted samples wait for the update to finish
        local_engine.load_weights(local_engine.model.state_dict(), version + 1)
        engine.held = False
        preemption.end()
        return await group, metrics

    result, metrics = asyncio.run(main())
    assert metrics.restarts == 3 and engine.calls == 6
    assert all(s.policy_version == version + 1 for t in result.trajectories for s in t.steps)
    assert all(t.finish_reason is FinishReason.RESPONSE and t.infra_retries == 0 for t in result.trajectories)
