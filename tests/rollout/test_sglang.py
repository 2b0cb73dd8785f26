import asyncio

import numpy as np
import pytest
import torch

from osvl.rl.trajectory import FinishReason
from osvl.rollout.agent import AgentConfig, run_trajectory
from osvl.rollout.engine import EngineError, GenerationRequest, SamplingParams
from osvl.rollout.local_engine import LocalEngine
from osvl.rollout.loopback import LoopbackServer
from osvl.rollout.parity import logprob_parity
from osvl.rollout.sglang import (
    SGLangConfig,
    SGLangEngine,
    generate_payload,
    parse_generate_response,
)
from osvl.rollout.workers import RolloutConfig, stream_groups
from tests.rollout.helpers import IMAGE_CONFIG, prompts, tiny_model, tokenizer

AGENT = AgentConfig(max_turns=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=10))


async def _groups(engine, env, renderer, n=3, g=2):
    out = [grp async for grp in stream_groups(prompts(n), engine, env, renderer, AGENT, RolloutConfig(group_size=g))]
    await engine.aclose()
    return out


def test_two_loopback_servers_give_valid_records_with_engine_parity(local_engine, env, renderer):
    with LoopbackServer(local_engine) as a, LoopbackServer(local_engine) as b:
        engine = SGLangEngine(SGLangConfig((a.url, b.url), routing="round_robin"))
        groups = asyncio.run(_groups(engine, env, renderer))
    trajectories = [t for grp in groups for t in grp.trajectories]
    assert len(trajectories) == 6 and all(t.finish_reason is not FinishReason.INFRA_ERROR for t in trajectories)
    for traj in trajectories:
        rendered = renderer.render_trajectory(traj)  # pads match images, ids in vocabulary
        assert len(rendered.images) >= 1
    report = logprob_parity(local_engine.model, renderer, trajectories, backend="torch")  # kernel path: test_workers
    assert report.tokens > 0 and report.mean_abs_diff < 1e-5


def test_sglang_client_reproduces_the_local_engine(local_engine, renderer):
    segment = renderer.render_prompt(prompts(1)[0])
    request = GenerationRequest(segment.ids, segment.images, SamplingParams(max_new_tokens=8, seed=42))
    direct = local_engine.generate_batch([request])[0]
    with LoopbackServer(local_engine) as server:
        engine = SGLangEngine(SGLangConfig((server.url,)))
        remote = asyncio.run(engine.generate(request))
    assert remote.token_ids == direct.token_ids
    np.testing.assert_allclose(remote.logprobs, direct.logprobs, atol=1e-6)


def test_weight_update_from_disk(tmp_path):
    engine_side = LocalEngine(tiny_model(seed=0), tokenizer(), IMAGE_CONFIG)
    path = tmp_path / "weights.pt"
    torch.save(tiny_model(seed=1).state_dict(), path)

    async def main(url):
        client = SGLangEngine(SGLangConfig((url,)))
        await client.update_weights_from_disk(str(path), version=7)
        with pytest.raises(EngineError, match="refused"):
            await client.update_weights_from_disk(str(tmp_path / "missing.pt"), version=8)
        result = await client.generate(GenerationRequest([1, 2, 3], sampling=SamplingParams(max_new_tokens=2)))
        await client.aclose()
        return client.policy_version, result.policy_version

    with LoopbackServer(engine_side) as server:
        assert asyncio.run(main(server.url)) == (7, 7)
    assert engine_side.policy_version == 7
    torch.testing.assert_close(engine_side.model.state_dict()["norm.weight"], tiny_model(seed=1).state_dict()["norm.weight"])


def test_dead_server_is_an_infra_error_for_that_trajectory(env, renderer):
    engine = SGLangEngine(SGLangConfig(("http://127.0.0.1:9",), timeout_s=2.0))
    traj = asyncio.run(run_trajectory(prompts(1)[0], engine, env, renderer, AGENT, group_id=0, sample_index=0))
    assert traj.finish_reason is FinishReason.INFRA_ERROR


def test_least_loaded_routing_picks_the_idle_server():
    engine = SGLangEngine(SGLangConfig(("http://a", "http://b", "http://c")))
    engine.in_flight[:] = [3, 1, 2]
    assert engine._pick() == 1
    rr = SGLangEngine(SGLangConfig(("http://a", "http://b"), routing="round_robin"))
    assert [rr._pick() for _ in range(4)] == [0, 1, 0, 1]


def test_payload_and_response_protocol():
    request = GenerationRequest([1, 2], sampling=SamplingParams(max_new_tokens=4, seed=3, stop_token_ids=(9,)))
    payload = generate_payload(request)
    assert payload["return_logprob"] and payload["sampling_params"]["sampling_seed"] == 3
    assert payload["sampling_params"]["stop_token_ids"] == [9] and "image_data" not in payload
    body = {"output_ids": [5, 9], "meta_info": {"finish_reason": {"type": "stop", "matched": 9},
                                                "output_token_logprobs": [[-0.5, 5, None], [-1.5, 9, None]]}}
    result = parse_generate_response(body, 2)
    assert result.token_ids == [5, 9] and result.logprobs == [-0.5, -1.5] and result.policy_version == 2
    for bad in ({"meta_info": {}}, {**body, "output_ids": [5]},
                {"meta_info": {**body["meta_info"], "finish_reason": {"type": "abort"}}}):
        with pytest.raises(EngineError):
            parse_generate_response(bad, 0)
    with pytest.raises(ValueError, match="http"):
        SGLangConfig(("localhost:30000",))
    with pytest.raises(ValueError, match="routing"):
        SGLangConfig(("http://a",), routing="random")
