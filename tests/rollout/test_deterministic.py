"""Deterministic rollouts: a request's result does not depend on what else is in flight, and the
SGLang client refuses servers that do not run deterministic inference when the recipe asks for it."""

from __future__ import annotations

import asyncio

import pytest

import osvl.rollout.local_engine as local_engine_module
from osvl.data.image import process_image
from osvl.rollout.engine import EngineError, GenerationRequest, SamplingParams
from osvl.rollout.local_engine import LocalEngine
from osvl.rollout.sglang import DETERMINISTIC_FLAG, SGLangConfig, SGLangEngine, server_determinism
from osvl.serve.loopback_engine import LoopbackServer
from tests.rollout.helpers import IMAGE_CONFIG, rgb, tiny_model, tokenizer


def _request(text: str, seed: int, max_new_tokens: int = 12, image: bool = False) -> GenerationRequest:
    tok = tokenizer()
    ids = tok.encode(text)
    images = []
    if image:
        processed = process_image(rgb(8, 10, seed), IMAGE_CONFIG)
        ids = [tok.special.vision_start, *[tok.special.image_pad] * processed.num_tokens, tok.special.vision_end, *ids]
        images = [processed]
    return GenerationRequest(
        ids, images, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop=(), seed=seed)
    )


def _engine(**kwargs) -> LocalEngine:
    return LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, **kwargs)


def _key(result):
    return result.token_ids, result.logprobs, result.finish


def test_a_request_gives_the_same_result_alone_and_in_any_batch():
    engine = _engine(deterministic=True)
    target = _request("Which bridge is shown in the image?", seed=7, image=True)
    others = [
        _request("The Kessock Bridge opened in 1982. " * (1 + i), seed=i, max_new_tokens=4 + 5 * i) for i in range(4)
    ]
    alone = _key(engine.generate_batch([target])[0])
    assert len(alone[0]) == 12
    assert _key(engine.generate_batch([*others, target])[-1]) == alone
    assert _key(engine.generate_batch([others[2], target, others[0]])[1]) == alone  # another order, another batch


def test_deterministic_mode_runs_every_forward_on_one_sequence(monkeypatch):
    """The mechanism: nothing in a forward depends on other requests, so no CPU's GEMM or reduction
    order can make the result depend on them."""
    seen = []
    real = local_engine_module.extend

    def recording(model, cache, ids, *args, **kwargs):
        seen.append((ids.shape[0], cache.capacity))
        return real(model, cache, ids, *args, **kwargs)

    monkeypatch.setattr(local_engine_module, "extend", recording)
    requests = [_request("bridge " * (1 + 2 * i), seed=i, max_new_tokens=3 + i) for i in range(3)]
    _engine(deterministic=True).generate_batch(requests)
    assert {rows for rows, _ in seen} == {1}
    capacities = {capacity for _, capacity in seen}
    assert capacities == {len(r.input_ids) + r.sampling.max_new_tokens for r in requests}  # each its own
    seen.clear()
    _engine().generate_batch(requests)  # the batched default pads all three into one forward
    assert {rows for rows, _ in seen} == {3}


def test_concurrent_requests_batch_in_the_queue_but_decode_alone():
    engine = _engine(max_batch=8, deterministic=True)
    requests = [_request("bridge " * (1 + i), seed=10 + i) for i in range(6)]

    async def concurrently():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    together = [_key(r) for r in asyncio.run(concurrently())]
    assert max(engine.batch_sizes) > 1  # they did arrive together
    assert together == [_key(engine.generate_batch([r])[0]) for r in requests]


def test_prefix_cache_is_refused_in_deterministic_mode():
    with pytest.raises(ValueError, match="prefix_cache_tokens must be 0 in deterministic mode"):
        _engine(deterministic=True, prefix_cache_tokens=1024)


def test_sglang_preflight_reports_and_enforces_deterministic_inference():
    plain, deterministic = _engine(), _engine(deterministic=True)

    async def check(config):
        engine = SGLangEngine(config)
        try:
            return await engine.check_deterministic_inference()
        finally:
            await engine.aclose()

    with LoopbackServer(plain) as a, LoopbackServer(deterministic) as b:
        report = asyncio.run(check(SGLangConfig((a.url, b.url))))  # not asked for: reported, not enforced
        assert [r.enabled for r in report] == [False, True]
        assert "deterministic inference off" in report[0].describe()
        assert [r.enabled for r in asyncio.run(check(SGLangConfig((b.url,), deterministic=True)))] == [True]
        with pytest.raises(EngineError, match=f"{DETERMINISTIC_FLAG}.*{a.url}: deterministic inference off"):
            asyncio.run(check(SGLangConfig((b.url, a.url), deterministic=True)))


def test_server_info_without_the_field_cannot_confirm_determinism():
    assert server_determinism("http://x", {"attention_backend": "fa3"}).enabled is None
    with pytest.raises(EngineError, match="did not answer a JSON object"):
        server_determinism("http://x", ["not", "a", "dict"])


def test_deterministic_sglang_client_refuses_an_unseeded_sampled_request():
    engine = SGLangEngine(SGLangConfig(("http://127.0.0.1:9",), deterministic=True))
    request = GenerationRequest([1, 2], sampling=SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="per-request seed"):
        asyncio.run(engine.generate(request))
    asyncio.run(engine.aclose())
