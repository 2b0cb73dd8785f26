import asyncio
import functools

import pytest
import torch

from bench.rollout.engine_process import ProcessEngine, ProcessEngineConfig, save_weights
from osvl.rl.trajectory import FinishReason
from osvl.rollout.agent import AgentConfig
from osvl.rollout.engine import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    derive_seed,
)
from osvl.rollout.local_engine import LocalEngine
from osvl.rollout.workers import RolloutWorkerConfig, stream_groups
from tests.bench.rollout import factories
from tests.rollout.helpers import IMAGE_CONFIG, prompts, tiny_model, tokenizer
from tests.rollout.inline_tools import inline_environment, renderer_for
from tests.rollout.scripts import call, respond

TURNS = [call("echo", tag="x"), respond()]


def _request(seed: int) -> GenerationRequest:
    ids = tokenizer().encode("<|im_start|>user\nWhich bridge?<|im_end|>\n<|im_start|>assistant\n")
    return GenerationRequest(ids, [], SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed))


def _perturbed(model, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


def test_server_process_matches_the_local_engine_and_takes_versioned_weights(tmp_path):
    reference = LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG)
    config = ProcessEngineConfig(weights_dir=str(tmp_path))
    with ProcessEngine(factories.local_engine, config) as engine:
        pid = engine.pid
        assert pid is not None and engine.policy_version == 0
        got = asyncio.run(engine.generate(_request(7)))
        want = reference.generate_batch([_request(7)])[0]
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
        update = _perturbed(reference.model, 0.5)
        engine.load_weights(update, 3)
        reference.load_weights(update, 3)
        got = asyncio.run(engine.generate(_request(7)))
        want = reference.generate_batch([_request(7)])[0]
        assert got.policy_version == 3 and engine.policy_version == 3
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
        with pytest.raises(ValueError, match="weight update failed"):  # wrong names: nothing changes
            engine.load_weights({"not.a.weight": torch.zeros(2)}, 4)
        assert engine.policy_version == 3 and engine.pid == pid
        with pytest.raises(ValueError, match="policy version"):
            engine.load_weights(update, -1)
        with pytest.raises(ValueError, match="vocabulary"):  # bad input is the caller's error, not a crash
            asyncio.run(engine.generate(GenerationRequest([10**6])))
        # a restarted server comes back with the newest weights, not the factory's
        engine.kill()
        got = asyncio.run(engine.generate(_request(7)))
        assert engine.restarts == 1 and engine.pid != pid and got.policy_version == 3
        assert got.token_ids == want.token_ids
    assert len(list(tmp_path.iterdir())) == 0  # weight files are cleaned up


def test_a_killed_engine_server_ends_its_trajectories_as_infra_error_and_the_batch_completes():
    hang = derive_seed(0, "p1", 0)  # turn 0 of sample 0 of prompt p1 hangs until the server dies
    in_flight_at_kill = []

    class KillWhenHung:
        def __init__(self, inner):
            self.inner, self.running = inner, 0

        @property
        def policy_version(self):
            return self.inner.policy_version

        async def generate(self, request):
            if request.sampling.seed == hang:

                async def kill_soon():
                    await asyncio.sleep(0.3)
                    in_flight_at_kill.append(self.running)
                    self.inner.kill()  # SIGKILL: a real crash of the process owning the model

                asyncio.get_running_loop().create_task(kill_soon())
            self.running += 1
            try:
                return await self.inner.generate(request)
            finally:
                self.running -= 1

    agent = AgentConfig(max_turns=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=64))
    config = RolloutWorkerConfig(group_size=2, max_in_flight=4, trajectory_deadline_s=60, max_retries=0)
    factory = functools.partial(factories.replay_engine, TURNS, [hang])
    env = inline_environment()
    with ProcessEngine(factory) as server:
        engine = KillWhenHung(server)

        async def collect():
            return [g async for g in stream_groups(prompts(3), engine, env, renderer_for(env), agent, config)]

        groups = asyncio.run(collect())

        # Whether another request reached the server after the kill depends on timing; the next
        # batch must find it restarted (once) and complete normally.
        async def collect_after():
            return [g async for g in stream_groups(prompts(1), server, env, renderer_for(env), agent, config)]

        after = asyncio.run(collect_after())
        restarts = server.restarts
    assert all(t.finish_reason is FinishReason.RESPONSE for g in after for t in g.trajectories)
    trajectories = {(g.prompt.id, t.sample_index): t for g in groups for t in g.trajectories}
    assert sorted(g.group_id for g in groups) == [0, 1, 2] and len(trajectories) == 6
    assert trajectories[("p1", 0)].finish_reason is FinishReason.INFRA_ERROR
    failed = [k for k, t in trajectories.items() if t.finish_reason is FinishReason.INFRA_ERROR]
    assert restarts == 1 and 1 <= len(failed) <= in_flight_at_kill[0]
    for key, traj in trajectories.items():
        if key not in failed:
            assert traj.finish_reason is FinishReason.RESPONSE and traj.steps[0].tool_result.ok


def test_bad_factories_and_configs_are_clear_errors(tmp_path):
    with pytest.raises(EngineError, match="ValueError: no model here"):
        ProcessEngine(factories.broken_engine)
    with pytest.raises(ValueError, match="max_restarts"):
        ProcessEngineConfig(max_restarts=-1)
    with pytest.raises(ValueError, match="start_method"):
        ProcessEngineConfig(start_method="fork")
    with pytest.raises(ValueError, match="non-empty"):
        save_weights({}, 1, tmp_path)
