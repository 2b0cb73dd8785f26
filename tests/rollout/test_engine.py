import asyncio

import numpy as np
import pytest
import torch

from osvl.data.image import process_image
from osvl.model import build_model
from osvl.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
    derive_seed,
    hits_stop,
)
from osvl.rollout.kv_cache import KVCache, extend
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.rollout.sampling import make_generator, sample_next
from tests.model.tiny import image_batch, tiny_config
from tests.rollout.helpers import IMAGE_CONFIG, rgb, tiny_model, tokenizer


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": ("",)}, "stop strings"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"seed": -5}, "seed"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_request_and_result_validation():
    with pytest.raises(ValueError, match="at least one input id"):
        GenerationRequest([])
    with pytest.raises(ValueError, match="logprobs"):
        GenerationResult([1, 2], [0.0], StopKind.STOP)


def test_seeds_are_stable_and_distinct():
    seed = derive_seed(3, "p0", 1)
    assert seed == derive_seed(3, "p0", 1) and 0 <= seed < 2**63
    assert len({derive_seed(s, p, i) for s in range(3) for p in ("p0", "p1") for i in range(4)}) == 24


def test_hits_stop_on_ids_and_strings_completed_by_the_last_token():
    tok = tokenizer()
    decode = tok.decode
    ids = tok.encode("<response>1982</response>")
    assert hits_stop(ids, decode, ("</response>",), ())
    assert not hits_stop(ids[:-1], decode, ("</response>",), ())
    assert not hits_stop(ids + tok.encode(" x"), decode, ("</response>",), ())  # would have stopped earlier
    assert hits_stop([5, 7], decode, (), (7,)) and not hits_stop([], decode, ("x",), (7,))


def test_sample_next_greedy_top_p_and_logprob():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    token, logprob = sample_next(logits, 0.0, 1.0, None)
    assert token == 1 and logprob == pytest.approx(float(torch.log_softmax(logits.double(), 0)[1]), abs=1e-6)
    # top_p small enough keeps only the argmax; logprob is of the tempered, untruncated distribution
    token, logprob = sample_next(logits, 0.5, 0.1, make_generator(0))
    assert token == 1 and logprob == pytest.approx(float(torch.log_softmax(logits.double() / 0.5, 0)[1]), abs=1e-6)
    draws = {sample_next(logits, 1.0, 1.0, make_generator(s))[0] for s in range(40)}
    assert len(draws) >= 3


@pytest.mark.parametrize("moe", [False, True])
def test_kv_cache_matches_the_packed_forward_with_images(moe):
    torch.manual_seed(0)
    config = tiny_config(moe=moe)
    model = build_model(config)
    ids, cu, pos, pix, grid, _ = image_batch(config, [(1, 4, 4), (1, 2, 4)], n_text=3)
    with torch.no_grad():
        full = model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=pix, image_grid_thw=grid).double()
    starts = cu.tolist()
    rows = [ids[starts[b] : starts[b + 1]] for b in range(2)]
    rpos = [pos[:, starts[b] : starts[b + 1]] for b in range(2)]
    prefill = [len(r) - 2 for r in rows]  # prefill all but two tokens, then decode them one by one
    L = max(prefill)
    batch = torch.zeros(2, L, dtype=torch.long)
    bpos = torch.zeros(3, 2, L, dtype=torch.long)
    for b in range(2):
        batch[b, : prefill[b]] = rows[b][: prefill[b]]
        bpos[:, b, : prefill[b]] = rpos[b][:, : prefill[b]]
    cache = KVCache.empty(model, 2, max(len(r) for r in rows))
    logits = extend(model, cache, batch, torch.tensor(prefill), bpos, pix, grid).double()
    for b in range(2):
        torch.testing.assert_close(logits[b, : prefill[b]], full[starts[b] : starts[b] + prefill[b]], atol=1e-5, rtol=0)
    for step in range(2):
        t = [prefill[b] + step for b in range(2)]
        logits = extend(
            model,
            cache,
            torch.stack([rows[b][t[b]] for b in range(2)])[:, None],
            torch.tensor([1, 1]),
            torch.stack([rpos[b][:, t[b]] for b in range(2)], 1)[:, :, None],
        ).double()
        for b in range(2):
            torch.testing.assert_close(logits[b, 0], full[starts[b] + t[b]], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot take"):
        extend(model, cache, batch, torch.tensor(prefill), bpos, pix, grid)


@pytest.fixture(scope="module")
def engine():
    return LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, max_batch=4)


def _request(engine, seed, n_new=6, image_seed=0, text="Which bridge is shown?"):
    tok = engine.tokenizer
    image = process_image(rgb(8, 8, image_seed), IMAGE_CONFIG)
    ids = tok.encode(
        "<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * image.num_tokens
        + "<|vision_end|>"
        + text
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    return GenerationRequest(
        ids,
        [image],
        SamplingParams(temperature=1.0, max_new_tokens=n_new, seed=seed, stop_token_ids=(tok.special.im_end,)),
    )


def test_local_engine_is_reproducible_across_batch_composition_and_logprobs_match_scoring(engine):
    alone = engine.generate_batch([_request(engine, 11)])[0]
    batched = engine.generate_batch(
        [_request(engine, 5, 3, image_seed=1, text="x"), _request(engine, 11), _request(engine, 7, 9, image_seed=2)]
    )
    assert batched[1].token_ids == alone.token_ids
    np.testing.assert_allclose(batched[1].logprobs, alone.logprobs, atol=1e-5)
    for request, result in zip([_request(engine, 5, 3, image_seed=1, text="x"), _request(engine, 11)], batched):
        assert len(result.token_ids) <= request.sampling.max_new_tokens
        assert result.finish is (
            StopKind.STOP if result.token_ids[-1] == engine.tokenizer.special.im_end else StopKind.LENGTH
        )
        scored = engine.score(request, result.token_ids, temperature=1.0)
        np.testing.assert_allclose(result.logprobs, scored, atol=1e-5)
        assert all(lp <= 0 for lp in result.logprobs)


def test_async_generate_batches_concurrent_requests(engine):
    async def main():
        return await asyncio.gather(*[engine.generate(_request(engine, s)) for s in range(5)])

    results = asyncio.run(main())
    direct = engine.generate_batch([_request(engine, s) for s in range(5)])
    assert [r.token_ids for r in results] == [r.token_ids for r in direct]


def test_weight_updates_stamp_versions_and_reject_mismatches():
    engine = LocalEngine(tiny_model(seed=0), tokenizer(), IMAGE_CONFIG)
    request = _request(engine, 3)
    before = engine.generate_batch([request])[0]
    engine.load_weights(tiny_model(seed=1).state_dict(), version=4)
    after = engine.generate_batch([request])[0]
    assert before.policy_version == 0 and after.policy_version == 4
    assert after.logprobs != before.logprobs
    with pytest.raises(ValueError, match="does not match"):
        engine.load_weights({"nope": torch.zeros(1)}, version=5)
    assert engine.policy_version == 4


def test_local_engine_rejects_out_of_vocab_ids(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate_batch([GenerationRequest([10**6])])


def test_replay_engine_emits_script_with_model_logprobs_and_stops(engine):
    tok = engine.tokenizer
    script = tok.encode("<response>1982</response> trailing")
    replay = ReplayEngine(engine, lambda request: script)
    request = _request(engine, 0, n_new=64)
    request.sampling = SamplingParams(max_new_tokens=64)
    result = replay.replay(request)
    assert tok.decode(result.token_ids) == "<response>1982</response>" and result.finish is StopKind.STOP
    np.testing.assert_allclose(result.logprobs, engine.score(request, result.token_ids), atol=1e-6)
    request.sampling = SamplingParams(max_new_tokens=2)
    assert replay.replay(request).finish is StopKind.LENGTH
