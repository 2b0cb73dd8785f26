"""osvl's vLLM client without a server: the request it sends, how it reads answers and refusals,
and the recipe, serving and pre-flight pieces around it (the real server: ``test_vllm.py``)."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
import torch

from osvl.config import load_recipe
from osvl.data.image import ProcessedImage
from osvl.model import config_to_hf
from osvl.model.text_export import text_config_to_hf
from osvl.rollout import EngineError, GenerationRequest, SamplingParams, StopKind, VLLMConfig, VLLMEngine
from osvl.rollout.vllm import collapse_image_pads, generate_payload, parse_generate_response
from osvl.rollout.weight_sync import VLLMNCCLSync
from osvl.serve.commands import Layout, plan_commands
from osvl.serve.preflight import PreflightError, _check_vllm_servers, _served_arch_mismatch
from tests.rollout.helpers import model_config, tiny_model


def _body(ids, logprobs, finish="stop", versions=None, prompt_tokens=5):
    return {
        "usage": {"prompt_tokens": prompt_tokens},
        "choices": [
            {
                "token_ids": ids,
                "finish_reason": finish,
                "weight_versions": versions,
                "logprobs": {"content": [{"token_id": i, "logprob": p} for i, p in zip(ids, logprobs)]},
            }
        ],
    }


def test_payload_carries_ids_sampling_stops_seed_and_images():
    image = ProcessedImage(pixels=np.zeros((4, 6, 3), dtype=np.uint8), grid_thw=(1, 2, 3), num_tokens=1)
    request = GenerationRequest(
        [5, 6, 7],
        [],
        SamplingParams(
            temperature=0.7, top_p=0.9, max_new_tokens=12, stop=("</response>",), stop_token_ids=(3,), seed=11
        ),
    )
    payload = generate_payload(request)
    assert payload["token_ids"] == [5, 6, 7] and "content_parts" not in payload
    s = payload["sampling_params"]
    assert s == {
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 12,
        "logprobs": 0,
        "stop_token_ids": [3],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "detokenize": True,
        "stop": ["</response>"],
        "include_stop_str_in_output": True,
        "seed": 11,
    }
    no_strings = generate_payload(GenerationRequest([1], [], SamplingParams(stop=())))["sampling_params"]
    assert no_strings["detokenize"] is False and "stop" not in no_strings and "seed" not in no_strings
    with_image = generate_payload(GenerationRequest([1, 9, 2, 9], [image, image], SamplingParams()), image_token_id=9)
    assert [p["type"] for p in with_image["content_parts"]] == ["image_url", "image_url"]
    assert with_image["content_parts"][0]["url"].startswith("data:image/png;base64,")


def test_answers_become_results_with_the_servers_weight_version():
    result = parse_generate_response(_body([4, 9], [-0.5, -1.25], versions=[{"version": "3", "start": 0, "end": 2}]), 1)
    assert (result.token_ids, result.logprobs, result.finish, result.policy_version, result.prompt_tokens) == (
        [4, 9],
        [-0.5, -1.25],
        StopKind.STOP,
        3,
        5,
    )
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    assert parse_generate_response(_body([4, 9], [-1, -1], "length", spans), 1).policy_version == 3  # the oldest
    default = [{"version": "default", "start": 0, "end": 2}]  # before osvl's first update
    assert parse_generate_response(_body([4, 9], [-1, -1], versions=default), 7).policy_version == 7


@pytest.mark.parametrize(
    "body,match",
    [
        (_body([4], [-1.0], finish="abort"), "finish_reason 'abort'"),
        ({"choices": [{"token_ids": [4]}]}, "malformed"),
        ({"error": "boom"}, "malformed"),
        (
            {
                "choices": [
                    {
                        "token_ids": [4, 5],
                        "finish_reason": "stop",
                        "logprobs": {"content": [{"token_id": 4, "logprob": -1}, {"token_id": 6, "logprob": -1}]},
                    }
                ]
            },
            "disagree",
        ),
    ],
)
def test_malformed_or_aborted_answers_are_infra_errors(body, match):
    with pytest.raises(EngineError, match=match):
        parse_generate_response(body, 0)


def _engine(handler) -> VLLMEngine:
    return VLLMEngine(
        VLLMConfig(("http://vllm-a:1",), timeout_s=5), httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )


def test_refusals_and_outages_name_the_server():
    refused = _engine(lambda r: httpx.Response(400, json={"error": {"message": "bad sampling"}}))
    with pytest.raises(EngineError, match=r"vllm-a:1.*HTTP 400: bad sampling"):
        asyncio.run(refused.generate(GenerationRequest([1], [], SamplingParams())))

    def down(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(EngineError, match="vllm-a:1 unreachable"):
        asyncio.run(_engine(down).generate(GenerationRequest([1], [], SamplingParams())))


def test_disk_reload_pauses_reloads_sets_the_version_resumes_and_checks_it():
    calls, version = [], ["default"]

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(
            (
                request.method,
                request.url.path,
                request.url.query.decode(),
                json.loads(request.content) if request.content else None,
            )
        )
        if request.url.path == "/update_weight_version":
            version[0] = json.loads(request.content)["new_version"]
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": version[0]})
        if request.url.path == "/collective_rpc" and "bad" in request.content.decode():
            return httpx.Response(500, json={"error": {"message": "Worker failed"}})
        return httpx.Response(200, json={})

    engine = _engine(handler)
    asyncio.run(engine.update_weights_from_disk("/w/v000003", 3))
    assert [(m, p) for m, p, _, _ in calls] == [
        ("POST", "/pause"),
        ("POST", "/collective_rpc"),
        ("POST", "/update_weight_version"),
        ("POST", "/resume"),
        ("GET", "/weight_info"),
    ]
    assert calls[0][2] == "mode=wait"
    assert calls[1][3] == {"method": "reload_weights", "kwargs": {"weights_path": "/w/v000003"}}
    assert engine.policy_version == 3
    calls.clear()
    with pytest.raises(EngineError, match=r"weight reload to version 4 from /w/bad.*vllm-a:1.*Worker failed"):
        asyncio.run(engine.update_weights_from_disk("/w/bad", 4))
    assert [p for _, p, _, _ in calls] == ["/pause", "/collective_rpc", "/resume"]  # resumed, version untouched
    assert engine.policy_version == 3 and version[0] == "3"


def test_a_server_reporting_another_version_fails_the_confirmation():
    engine = _engine(lambda r: httpx.Response(200, json={"weight_version": "2"}))
    with pytest.raises(EngineError, match=r"skew after the update to 5: http://vllm-a:1 reports '2'"):
        asyncio.run(engine.confirm_version(5))


def test_recipe_keys_for_vllm():
    recipe = load_recipe(
        "tiny_grpo",
        ["rollout.engine=vllm", 'rollout.vllm_urls=["http://127.0.0.1:8200"]', "rollout.text_only_export=true"],
    )
    assert recipe.rollout.vllm_urls == ("http://127.0.0.1:8200",) and recipe.rollout.text_only_export
    with pytest.raises(ValueError, match="engine 'vllm' needs vllm_urls"):
        load_recipe("tiny_grpo", ["rollout.engine=vllm"])
    with pytest.raises(ValueError, match="vllm_urls must be http"):
        load_recipe("tiny_grpo", ["rollout.engine=vllm", 'rollout.vllm_urls=["127.0.0.1:8200"]'])


def test_serve_prints_vllm_servers_with_the_flags_the_client_needs():
    recipe = load_recipe("grpo_8b", ["rollout.weight_sync=distributed"])
    commands = plan_commands(recipe, Layout(1, 8, 4, ("node0",), False), "grpo_8b", "vllm")
    server = next(c for c in commands if c.what.startswith("vLLM server"))
    shell = server.shell()
    assert shell.startswith("VLLM_SERVER_DEV_MODE=1 CUDA_VISIBLE_DEVICES=4,5,6,7 vllm serve")
    for flag in (
        "--logprobs-mode processed_logprobs",
        "--enable-scale-out",
        "--generation-config vllm",
        f"--tensor-parallel-size {recipe.rollout.server_tp}",
        "--weight-transfer-config",
    ):
        assert flag in shell, flag
    trainer = commands[-1].shell()
    assert "rollout.engine=vllm" in trainer and "rollout.vllm_urls=" in trainer and "http://node0:8200" in trainer
    sglang = plan_commands(recipe, Layout(1, 8, 4, ("node0",), False), "grpo_8b", "sglang")
    assert any("sglang.launch_server" in c.shell() for c in sglang)
    with pytest.raises(ValueError, match="--router fronts SGLang"):
        plan_commands(recipe, Layout(1, 8, 4, ("node0",), True), "grpo_8b", "vllm")


def test_preflight_compares_a_served_text_export_or_whole_model_with_the_policy():
    arch, other = model_config(), model_config(moe=True)
    assert _served_arch_mismatch(text_config_to_hf(arch), arch) == []
    assert _served_arch_mismatch(config_to_hf(arch), arch) == []
    assert "num_experts 4 != trainer's 0" in "; ".join(_served_arch_mismatch(text_config_to_hf(other), arch))


def test_preflight_refuses_pre_temperature_logprobs_and_tokenizerless_servers(tmp_path):
    arch = model_config()
    (tmp_path / "config.json").write_text(json.dumps(text_config_to_hf(arch)))

    def server(model_config):
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/server_info":
                return httpx.Response(200, json={"vllm_config": {"model_config": model_config}})
            return httpx.Response(200, json={"weight_version": "0"})

        return _engine(handler)

    good = {"model": str(tmp_path), "logprobs_mode": "processed_logprobs", "skip_tokenizer_init": False}
    lines = asyncio.run(_check_vllm_servers(server(good), arch, stop_strings=True))
    assert "architecture and vocabulary match" in lines[0]
    with pytest.raises(PreflightError, match="--logprobs-mode processed_logprobs"):
        asyncio.run(_check_vllm_servers(server({**good, "logprobs_mode": "raw_logprobs"}), arch, True))
    with pytest.raises(PreflightError, match="skip-tokenizer-init"):
        asyncio.run(_check_vllm_servers(server({**good, "skip_tokenizer_init": True}), arch, True))
    with pytest.raises(PreflightError, match="num_hidden_layers"):
        wider = {**text_config_to_hf(arch), "num_hidden_layers": 3}
        (tmp_path / "config.json").write_text(json.dumps(wider))
        asyncio.run(_check_vllm_servers(server(good), arch, True))


def test_nccl_update_routes_follow_vllms_rl_api():
    """The GPU path's HTTP side (its NCCL data plane needs GPUs): the group join, then per update
    pause + start, one announcement per bucket, finish with the version + resume, then the check."""
    calls, version = [], {}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        host = request.url.host
        calls.append((host, request.url.path, body))
        if request.url.path == "/finish_weight_update":
            version[host] = body["weight_version"]
        if request.url.path == "/get_world_size":
            return httpx.Response(200, json={"world_size": 2})
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": version.get(host, "default")})
        return httpx.Response(200, json={})

    engine = VLLMEngine(
        VLLMConfig(("http://a:1", "http://b:2")), httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )

    async def update():
        sizes = await engine.server_ranks()
        await engine.init_weight_transfer(b"\x01" * 128, sizes)
        await engine.start_weight_update()
        await engine.update_weights(["model.norm.weight"], ["bfloat16"], [(8,)])
        await engine.finish_weight_update(7)

    asyncio.run(update())
    inits = {host: body["init_info"] for host, path, body in calls if path == "/init_weight_transfer_engine"}
    assert {h: i["rank_offset"] for h, i in inits.items()} == {"a": 1, "b": 3}  # trainer rank 0, then 2 ranks each
    assert all(
        i["world_size"] == 5 and base64.b64decode(i["nccl_unique_id_b64"]) == b"\x01" * 128 for i in inits.values()
    )
    for host in ("a", "b"):
        sequence = [(path, body) for h, path, body in calls if h == host]
        assert [path for path, _ in sequence] == [
            "/get_world_size",
            "/init_weight_transfer_engine",
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
            "/weight_info",
        ]
        assert sequence[4][1] == {
            "update_info": {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[8]]}
        }
        assert sequence[5][1] == {"weight_version": "7"}
    assert engine.policy_version == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_nccl_sync_refuses_without_cuda_and_names_the_way_that_works():
    engine = _engine(lambda r: httpx.Response(200, json={"world_size": 1}))
    with asyncio.Runner() as runner:
        sync = VLLMNCCLSync(engine, torch.float32, runner.run, bucket_bytes=1 << 20)
        with pytest.raises(EngineError, match="needs CUDA \\(NCCL\\); use 'disk' on CPU"):
            sync.sync(tiny_model(0), 1)


def test_images_go_as_one_pad_each_for_vllms_processor_to_expand():
    pad, a, b = (
        9,
        ProcessedImage(np.zeros((4, 4, 3), np.uint8), (1, 2, 2), 3),
        ProcessedImage(np.zeros((4, 8, 3), np.uint8), (1, 2, 4), 2),
    )
    ids = [1, 7, pad, pad, pad, 8, 2, 7, pad, pad, 8, 3]
    assert collapse_image_pads(ids, [a, b], pad) == [1, 7, pad, 8, 2, 7, pad, 8, 3]
    payload = generate_payload(GenerationRequest(ids, [a, b], SamplingParams()), image_token_id=pad)
    assert payload["token_ids"] == [1, 7, pad, 8, 2, 7, pad, 8, 3] and len(payload["content_parts"]) == 2
    with pytest.raises(ValueError, match=r"runs of lengths \[3, 2\] for images of \[2, 3\] tokens"):
        collapse_image_pads(ids, [b, a], pad)
    with pytest.raises(ValueError, match="needs VLLMConfig.image_token_id"):
        generate_payload(GenerationRequest(ids, [a, b], SamplingParams()))
