"""Weight updates while generation runs, as SGLang does them: ``/pause_generation`` (abort mode) ends the
requests in flight with the tokens they have and holds new ones until ``/continue_generation``. The
SGLang client continues an aborted request from its tokens (``partial_rollouts = "keep"``: each token
keeps its logprob and the version that produced it) or raises ``GenerationPreempted`` ("restart").

End to end on the loopback server over a real local engine (the pause lands inside a generation, at a
decode step chosen by the test), and the client's side against scripted responses."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import torch

import osvl.rollout.local_engine as local_engine_module
from osvl.model import save_pretrained
from osvl.rollout.engine import EngineError, GenerationPreempted, GenerationRequest, SamplingParams, StopKind
from osvl.rollout.local_engine import LocalEngine
from osvl.rollout.sglang import MAX_IDLE_ABORTS, SGLangConfig, SGLangEngine
from osvl.serve.loopback_engine import LoopbackServer
from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer

FREE = SamplingParams(temperature=1.0, max_new_tokens=24, stop=(), stop_token_ids=(), seed=7)  # runs to the end


def pause_at_decode_step(monkeypatch, engine: LocalEngine, url: str, step: int) -> threading.Thread:
    """Pauses the server from inside the engine's ``step``-th forward (the prefill is the first): that
    forward finishes once the abort is set, so the request ends with ``step - 1`` tokens."""
    real, calls = local_engine_module.extend, [0]
    pauser = threading.Thread(
        target=lambda: httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=60, trust_env=False)
    )

    def extend(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            pauser.start()
            assert engine._abort.wait(30), "the pause never reached the engine"
        return real(*args, **kwargs)

    monkeypatch.setattr(local_engine_module, "extend", extend)
    return pauser


@pytest.fixture
def served(tmp_path):
    """A fresh engine (weights of seed 0, version 0) behind a loopback server, and a checkpoint of other
    weights (seed 1) to update to."""
    engine = LocalEngine(tiny_model(0), tokenizer(), IMAGE_CONFIG, max_batch=4)
    save_pretrained(tiny_model(1), tmp_path / "v1", dtype=torch.float32)
    with LoopbackServer(engine) as server:
        yield engine, server, tmp_path / "v1"


def _request() -> GenerationRequest:
    return GenerationRequest(tokenizer().encode("Which bridge is shown? The Kessock Bridge"), [], FREE)


def test_keep_continues_an_aborted_request_on_the_new_weights(served, monkeypatch):
    engine, server, new_weights = served
    pauser = pause_at_decode_step(monkeypatch, engine, server.url, step=6)
    client = SGLangEngine(SGLangConfig((server.url,)), decode=tokenizer().decode)

    async def main():
        generation = asyncio.ensure_future(client.generate(_request()))
        while not pauser.is_alive() and not pauser.ident:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(pauser.join)  # paused: the request was aborted after 5 tokens
        assert not generation.done()  # its continuation waits at the paused server
        await client.update_weights_from_disk(str(new_weights), 1)
        await client.continue_generation()
        result = await generation
        await client.aclose()
        return result

    result = asyncio.run(main())
    assert len(result.token_ids) == FREE.max_new_tokens and result.finish is StopKind.LENGTH
    assert result.policy_version == 0 and result.token_versions == [0] * 5 + [1] * 19
    request = _request()
    old = LocalEngine(tiny_model(0), tokenizer(), IMAGE_CONFIG).score(request, result.token_ids[:5])
    new = LocalEngine(tiny_model(1), tokenizer(), IMAGE_CONFIG)
    continued = GenerationRequest([*request.input_ids, *result.token_ids[:5]], [], FREE)
    assert result.logprobs[:5] == pytest.approx(old, abs=1e-4)  # each token's engine logprob, of its own weights
    assert result.logprobs[5:] == pytest.approx(new.score(continued, result.token_ids[5:]), abs=1e-4)


def test_restart_raises_preempted_and_new_requests_wait_while_paused(served, monkeypatch):
    engine, server, _ = served
    pauser = pause_at_decode_step(monkeypatch, engine, server.url, step=4)
    client = SGLangEngine(SGLangConfig((server.url,), partial_rollouts="restart"))

    async def main():
        with pytest.raises(GenerationPreempted, match="aborted after 3 tokens"):
            await client.generate(_request())
        await asyncio.to_thread(pauser.join)
        waiting = asyncio.ensure_future(client.generate(_request()))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held by the pause, never run on the weights being replaced
        await client.continue_generation()
        result = await waiting
        await client.aclose()
        return result

    assert len(asyncio.run(main()).token_ids) == FREE.max_new_tokens


def test_pause_modes_other_than_abort_are_refused(served):
    _, server, _ = served
    response = httpx.post(f"{server.url}/pause_generation", json={"mode": "retract"}, timeout=30, trust_env=False)
    assert response.status_code == 400 and "abort only" in response.text


def _answers(*bodies):
    """A transport that answers successive /generate calls with ``bodies`` and records the requests."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=bodies[len(sent) - 1])

    return httpx.MockTransport(handle), sent


def _body(ids, finish, version, logprob=-0.5):
    return {
        "output_ids": ids,
        "meta_info": {
            "output_token_logprobs": [[logprob, i, None] for i in ids],
            "finish_reason": {"type": finish},
            "weight_version": str(version),
            "prompt_tokens": 3,
        },
    }


def _client(transport, **config):
    return SGLangEngine(
        SGLangConfig(("http://127.0.0.1:1",), **config),
        httpx.AsyncClient(transport=transport),
        decode=tokenizer().decode,
    )


def test_client_continuation_payload_versions_and_a_stop_string_across_the_seam():
    tok = tokenizer()
    head, tail = tok.encode("<think>Done.</think>\n<response>1982</resp"), tok.encode("onse> and more")
    transport, sent = _answers(_body(head, "abort", 3, -0.1), _body(tail, "length", 5, -0.2))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64, seed=1)
    result = asyncio.run(_client(transport).generate(GenerationRequest([1, 2, 3], [], sampling)))
    assert sent[1]["input_ids"] == [1, 2, 3, *head]  # the continuation goes on from the tokens it got
    assert sent[1]["sampling_params"]["max_new_tokens"] == 64 - len(head)
    assert result.finish is StopKind.STOP and tok.decode(result.token_ids).endswith("</response>")
    kept = len(result.token_ids) - len(head)
    assert 0 < kept < len(tail)  # cut where the stop string ends, not where the server stopped
    assert result.logprobs == [-0.1] * len(head) + [-0.2] * kept
    assert result.policy_version == 3 and result.token_versions == [3] * len(head) + [5] * kept


def test_client_gives_up_on_aborts_that_bring_nothing_and_restart_mode_raises():
    transport, _ = _answers(*[_body([], "abort", 0)] * MAX_IDLE_ABORTS)
    with pytest.raises(EngineError, match=f"aborted {MAX_IDLE_ABORTS} times in a row"):
        asyncio.run(_client(transport).generate(GenerationRequest([1], [], FREE)))
    transport, _ = _answers(_body([5, 6], "abort", 0))
    with pytest.raises(GenerationPreempted):
        asyncio.run(_client(transport, partial_rollouts="restart").generate(GenerationRequest([1], [], FREE)))
    transport, _ = _answers(_body([5, 6], "stop", 2))
    result = asyncio.run(_client(transport).generate(GenerationRequest([1], [], FREE)))
    assert result.token_versions is None and result.policy_version == 2  # one version: no per-token list
