import asyncio
import json

import httpx
import numpy as np
import pytest
import torch

from osvl.model import save_pretrained
from osvl.rl.trajectory import FinishReason
from osvl.rollout.agent import AgentConfig, run_trajectory
from osvl.rollout.engine import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
)
from osvl.rollout.local_engine import LocalEngine
from osvl.rollout.parity import logprob_parity
from osvl.rollout.sglang import (
    SGLangConfig,
    SGLangEngine,
    generate_payload,
    parse_generate_response,
)
from osvl.rollout.workers import RolloutWorkerConfig, stream_groups
from osvl.serve.loopback_engine import (
    LoopbackServer,
    finish_reason,
    request_from_json,
    response_json,
)
from tests.rollout.helpers import IMAGE_CONFIG, prompts, tiny_model, tokenizer

AGENT = AgentConfig(max_turns=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=10))


async def _groups(engine, env, renderer, n=3, g=2):
    config = RolloutWorkerConfig(group_size=g)
    out = [grp async for grp in stream_groups(prompts(n), engine, env, renderer, AGENT, config)]
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
    request = GenerationRequest(segment.ids, segment.images, SamplingParams(temperature=0.0, max_new_tokens=8))
    direct = local_engine.generate_batch([request])[0]
    with LoopbackServer(local_engine) as server:
        engine = SGLangEngine(SGLangConfig((server.url,)))
        remote = asyncio.run(engine.generate(request))
    assert remote.token_ids == direct.token_ids
    np.testing.assert_allclose(remote.logprobs, direct.logprobs, atol=1e-6)


def test_weight_update_from_disk_loads_an_hf_directory_and_confirms_the_version(tmp_path):
    engine_side = LocalEngine(tiny_model(seed=0), tokenizer(), IMAGE_CONFIG)
    save_pretrained(tiny_model(seed=1), tmp_path / "v7", dtype=torch.float32)

    async def main(url):
        client = SGLangEngine(SGLangConfig((url,)))
        await client.update_weights_from_disk(str(tmp_path / "v7"), version=7)
        with pytest.raises(EngineError, match=f"{url}.*missing"):
            await client.update_weights_from_disk(str(tmp_path / "missing"), version=8)
        result = await client.generate(GenerationRequest([1, 2, 3], sampling=SamplingParams(max_new_tokens=2)))
        info = await client.get_json(url, "/get_model_info")
        await client.aclose()
        return client.policy_version, result.policy_version, info["weight_version"]

    with LoopbackServer(engine_side) as server:
        assert asyncio.run(main(server.url)) == (7, 7, "7")
    assert engine_side.policy_version == 7
    torch.testing.assert_close(
        engine_side.model.state_dict()["norm.weight"], tiny_model(seed=1).state_dict()["norm.weight"]
    )


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
    body = {
        "output_ids": [5, 9],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 9},
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 9, None]],
        },
    }
    result = parse_generate_response(body, 2)
    assert result.token_ids == [5, 9] and result.logprobs == [-0.5, -1.5] and result.policy_version == 2
    for bad in (
        {"meta_info": {}},
        {**body, "output_ids": [5]},
        {"meta_info": {**body["meta_info"], "finish_reason": {"type": "abort"}}},
    ):
        with pytest.raises(EngineError):
            parse_generate_response(bad, 0)
    with pytest.raises(ValueError, match="http"):
        SGLangConfig(("localhost:30000",))
    with pytest.raises(ValueError, match="routing"):
        SGLangConfig(("http://a",), routing="random")


def test_wire_format_of_generate_matches_sglang(local_engine, renderer):
    """The exact JSON the client sends, and the response shape the loopback answers and the client parses
    (fields verified against SGLang's GenerateReqInput, SamplingParams and tokenizer manager)."""
    segment = renderer.render_prompt(prompts(1)[0])
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, max_new_tokens=5, stop=("</tool_call>",), stop_token_ids=(3, 1), seed=11
    )
    payload = generate_payload(GenerationRequest(segment.ids, segment.images, sampling))
    image_urls = payload.pop("image_data")
    assert payload == {
        "input_ids": segment.ids,
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_text_in_logprobs": False,
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop": ["</tool_call>"],
            "stop_token_ids": [3, 1],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "sampling_seed": 11,
        },
    }
    assert len(image_urls) == 1 and image_urls[0].startswith("data:image/png;base64,")
    payload["image_data"] = image_urls
    wire = json.loads(json.dumps(payload))
    decoded = request_from_json(wire, local_engine)  # the loopback reads back what was sent
    assert decoded.input_ids == segment.ids and decoded.sampling == sampling
    assert np.array_equal(decoded.images[0].pixels, segment.images[0].pixels)
    assert "sampling_seed" not in generate_payload(GenerationRequest([1], sampling=SamplingParams()))["sampling_params"]

    with LoopbackServer(local_engine) as server:
        body = httpx.post(f"{server.url}/generate", json=wire, timeout=60).json()
        health = httpx.get(f"{server.url}/health", timeout=10)
        refused = httpx.post(
            f"{server.url}/generate",
            timeout=10,
            json={**wire, "sampling_params": {**wire["sampling_params"], "top_k": 5}},
        )
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert set(meta) == {  # the keys a real SGLang 0.5.23 answers that osvl reads or that say what it did
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "num_retractions",
        "input_token_logprobs",
        "output_token_logprobs",
        "weight_version",
        "weight_versions",
        "e2e_latency",
    }
    assert meta["weight_version"] == "default" and meta["input_token_logprobs"] == []  # no update yet
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(body["output_ids"])}]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(len(entry) == 3 and entry[2] is None for entry in meta["output_token_logprobs"])
    assert meta["prompt_tokens"] == len(segment.ids) and meta["completion_tokens"] == len(body["output_ids"])
    reason = meta["finish_reason"]
    assert reason in (
        {"type": "length", "length": 5},
        {"type": "stop", "matched": body["output_ids"][-1]},
        {"type": "stop", "matched": "</tool_call>"},
    )
    result = parse_generate_response(body, 0)
    assert result.token_ids == body["output_ids"] and result.prompt_tokens == len(segment.ids)
    assert health.status_code == 200 and health.content == b""
    assert refused.status_code == 400 and "top_k" in refused.json()["error"]["message"]


def test_parse_a_real_sglang_response_body():
    body = {
        "text": "a</tool_call>",
        "output_ids": [7, 8],
        "meta_info": {
            "id": "9f",
            "finish_reason": {"type": "stop", "matched": "</tool_call>"},
            "prompt_tokens": 12,
            "completion_tokens": 2,
            "cached_tokens": 10,
            "weight_version": "3",
            "e2e_latency": 0.1,
            "output_token_logprobs": [[-0.1, 7, "a"], [-999999999.0, 8, "</tool_call>"]],
        },
    }
    result = parse_generate_response(body, 3)
    assert result.token_ids == [7, 8] and result.logprobs == [-0.1, -999999999.0] and result.finish is StopKind.STOP
    assert result.prompt_tokens == 12 and result.policy_version == 3
    length = {**body, "meta_info": {**body["meta_info"], "finish_reason": {"type": "length", "length": 2}}}
    assert parse_generate_response(length, 3).finish is StopKind.LENGTH


def test_weight_update_wire_format_and_version_confirmation():
    sent, reported = [], {"version": "7"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            sent.append(("GET", request.url.host, request.url.path))
            return httpx.Response(200, json={"model_path": "/ckpt", "weight_version": reported["version"]})
        sent.append((request.url.path, json.loads(request.content)))
        if json.loads(request.content)["model_path"] == "/ckpt/missing":
            return httpx.Response(400, json={"success": False, "message": "no such dir", "num_paused_requests": 0})
        return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})

    async def main():
        client = SGLangEngine(
            SGLangConfig(("http://router",), update_urls=("http://a", "http://b")),
            httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        )
        await client.update_weights_from_disk("/ckpt/step7", version=7)
        with pytest.raises(EngineError, match="http://a: HTTP 400: no such dir.*http://b: HTTP 400: no such dir"):
            await client.update_weights_from_disk("/ckpt/missing", version=8)
        reported["version"] = "6"  # a server that accepted the update but still serves the old weights
        with pytest.raises(EngineError, match="skew after the update to 9: http://a reports '6'; http://b reports '6'"):
            await client.update_weights_from_disk("/ckpt/step9", version=9)
        await client.aclose()
        return client.policy_version

    assert asyncio.run(main()) == 7
    assert sent[0] == ("/update_weights_from_disk", {"model_path": "/ckpt/step7", "weight_version": "7"})
    assert {s for s in sent[:4] if s[0] == "GET"} == {("GET", "a", "/get_model_info"), ("GET", "b", "/get_model_info")}
    assert not any(s[0] != "GET" and "router" in str(s) for s in sent)  # updates go to the workers, never the router


@pytest.mark.parametrize(
    "body, message",
    [
        ([1, 2], "JSON object"),
        ({"input_ids": [[1, 2]]}, "flat list"),
        ({"input_ids": []}, "flat list"),
        ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
        ({"input_ids": [1], "text": "hi"}, "text"),
        ({"input_ids": [1], "sampling_params": [{}]}, "one JSON object"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {"3": -100}}}, "logit_bias"),
        ({"input_ids": [1], "image_data": "data:image/png;base64,AAAA"}, "image_data"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ],
)
def test_loopback_refuses_requests_it_cannot_honor(local_engine, body, message):
    with pytest.raises(ValueError, match=message):
        request_from_json(body, local_engine)


def test_loopback_finish_reason_and_response_shape(local_engine):
    request = GenerationRequest([1, 2], sampling=SamplingParams(stop=("</response>",), stop_token_ids=(9,)))
    tok = tokenizer()
    by_id = GenerationResult([5, 9], [-1.0, -2.0], StopKind.STOP, prompt_tokens=2)
    by_text = GenerationResult(
        tok.encode("<response>1</response>"),
        [-1.0] * len(tok.encode("<response>1</response>")),
        StopKind.STOP,
        prompt_tokens=2,
    )
    by_length = GenerationResult([5, 6, 7], [-1.0] * 3, StopKind.LENGTH, prompt_tokens=2)
    assert finish_reason(by_id, request, local_engine) == {"type": "stop", "matched": 9}
    assert finish_reason(by_text, request, local_engine) == {"type": "stop", "matched": "</response>"}
    assert finish_reason(by_length, request, local_engine) == {"type": "length", "length": 3}
    body = response_json(by_id, request, {"return_logprob": True, "return_text_in_logprobs": True}, local_engine, "r1")
    assert body["meta_info"]["output_token_logprobs"] == [[-1.0, 5, tok.decode([5])], [-2.0, 9, tok.decode([9])]]
    assert "output_token_logprobs" not in response_json(by_id, request, {}, local_engine, "r1")["meta_info"]


def test_loopback_answers_as_a_real_sglang_0_5_23(local_engine, tmp_path):
    """The shapes a real SGLang 0.5.23 server was seen to answer (docs/inference_engines.md)."""
    save_pretrained(tiny_model(seed=1), tmp_path / "v1", dtype=torch.float32)
    with LoopbackServer(local_engine) as server:

        def post(path, body):
            return httpx.post(f"{server.url}{path}", json=body, timeout=60, trust_env=False)

        missing = httpx.get(f"{server.url}/get_weight_version", timeout=10, trust_env=False)
        flushed = post("/flush_cache", {})
        version = post("/update_weight_version", {"new_version": "3"})
        no_path = post("/update_weights_from_disk", {"weight_version": "9"})
        outside = post("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "group_name": "g"})
        ended_first = post("/end_weight_update", {})
        opened, again, closed = (
            post(p, {}) for p in ("/begin_weight_update", "/begin_weight_update", "/end_weight_update")
        )
        info = httpx.get(f"{server.url}/get_server_info", timeout=10, trust_env=False).json()
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.\n")
    assert version.json() == {"success": True, "message": "Weight version updated to 3", "new_version": "3"}
    assert no_path.status_code == 400
    assert {k: no_path.json()[k] for k in ("object", "type", "code")} == {
        "object": "error",
        "type": "Bad Request",
        "code": 400,
    }
    assert "model_path" in no_path.json()["message"]
    assert outside.status_code == 400 and outside.json() == {
        "success": False,
        "message": "ValueError: update_weights_from_distributed must run between begin_weight_update() and "
        "end_weight_update()",
        "num_paused_requests": 0,
    }
    assert ended_first.status_code == 400 and "no weight-update session is open" in ended_first.json()["message"]
    assert [r.status_code for r in (opened, again, closed)] == [200, 400, 200]
    assert "already open" in again.json()["message"]
    assert info["skip_tokenizer_init"] is False and info["max_running_requests"] == local_engine.max_batch


def test_loopback_samples_with_the_seed_only_when_deterministic(local_engine):
    """SGLang uses ``sampling_seed`` only under --enable-deterministic-inference: two requests with one seed
    sample alike on a deterministic server and (over 16 tokens of a 400-token vocabulary) differently otherwise."""
    body = {
        "input_ids": tokenizer().encode("Which bridge?"),
        "sampling_params": {"max_new_tokens": 16, "sampling_seed": 5},
    }
    deterministic = LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, deterministic=True)
    outputs = {}
    for name, engine in (("plain", local_engine), ("deterministic", deterministic)):
        with LoopbackServer(engine) as server:
            outputs[name] = [
                httpx.post(f"{server.url}/generate", json=body, timeout=60, trust_env=False).json()["output_ids"]
                for _ in range(2)
            ]
    assert outputs["deterministic"][0] == outputs["deterministic"][1]
    assert outputs["plain"][0] != outputs["plain"][1]
