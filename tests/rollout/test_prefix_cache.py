import numpy as np
import pytest
import torch

from osvl.data.image import process_image
from osvl.rollout.engine import GenerationRequest, SamplingParams
from osvl.rollout.local_engine import LocalEngine
from osvl.rollout.prefix_cache import Prefix, PrefixCache
from tests.rollout.helpers import IMAGE_CONFIG, rgb, tiny_model, tokenizer


def _image(seed):
    return process_image(rgb(8, 8, seed), IMAGE_CONFIG)


def _first_turn(seed, image_seed=0):
    tok = tokenizer()
    image = _image(image_seed)
    ids = tok.encode(
        "<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * image.num_tokens
        + "<|vision_end|>"
        + "Which bridge is shown?<|im_end|>\n<|im_start|>assistant\n"
    )
    return GenerationRequest(ids, [image], SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed))


def _next_turn(first, generated, seed, image_seed=5):
    """The first turn's context + its generation + an observation carrying a new image."""
    tok = tokenizer()
    image = _image(image_seed)
    observation = tok.encode(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n<|vision_start|>"
        + "<|image_pad|>" * image.num_tokens
        + "<|vision_end|>echo</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return GenerationRequest(
        first.input_ids + generated + observation,
        [*first.images, image],
        SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed),
    )


def test_next_turns_reuse_the_cached_context_with_unchanged_logprobs():
    plain = LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG)
    cached = LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, prefix_cache_tokens=4096)
    firsts = [_first_turn(1), _first_turn(2, image_seed=3)]
    turn1 = cached.generate_batch(firsts)
    assert [r.token_ids for r in turn1] == [r.token_ids for r in plain.generate_batch(firsts)]
    seconds = [_next_turn(f, r.token_ids, 10 + i) for i, (f, r) in enumerate(zip(firsts, turn1))]
    prefilled = cached.prefilled_tokens
    got = cached.generate_batch(seconds)
    want = plain.generate_batch(seconds)
    assert cached.prefix_cache.hits == 2  # both rows reused their first turn
    reused = cached.prefix_cache.reused_tokens
    assert reused == sum(len(f.input_ids) + len(r.token_ids) - 1 for f, r in zip(firsts, turn1))
    assert cached.prefilled_tokens - prefilled == sum(len(s.input_ids) for s in seconds) - reused
    for g, w, s in zip(got, want, seconds):
        assert g.token_ids == w.token_ids and g.prompt_tokens == len(s.input_ids)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        np.testing.assert_allclose(g.logprobs, plain.score(s, g.token_ids), atol=1e-5)


def test_prefixes_need_the_same_images_and_the_same_weights():
    engine = LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, prefix_cache_tokens=4096)
    first = _first_turn(1)
    generated = engine.generate_batch([first])[0].token_ids
    other_image = _next_turn(first, generated, 4)
    other_image.images[0] = _image(9)  # same ids, different pixels: the cached keys do not apply
    engine.generate_batch([other_image])
    assert engine.prefix_cache.hits == 0
    engine.load_weights(tiny_model(seed=1).state_dict(), version=2)
    assert len(engine.prefix_cache) == 0  # old weights' keys/values are gone
    engine.generate_batch([_next_turn(first, generated, 4)])
    assert engine.prefix_cache.hits == 0


def test_prefix_cache_eviction_and_validation():
    def entry(ids):
        empty = [torch.zeros(1, len(ids), 2)]
        return Prefix(tuple(ids), (), empty, empty)

    cache = PrefixCache(max_tokens=5)
    cache.store(entry([1, 2, 3]))
    cache.store(entry([1, 2]))
    assert cache.lookup([1, 2, 3, 4], []).ids == (1, 2, 3)  # the longest prefix wins
    assert cache.lookup([1, 2, 3], []).ids == (1, 2)  # only proper prefixes: one new token is needed
    cache.store(entry([7, 8, 9]))  # over budget: the least recently used entry goes
    assert len(cache) == 2 and cache.lookup([1, 2, 3, 4], []).ids == (1, 2)
    assert cache.lookup([1, 2, 3], ["img"]).ids == (1, 2) and cache.lookup([5, 6], []) is None
    cache.store(entry(range(6)))  # larger than the whole budget: not kept
    assert len(cache) == 2
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(0)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, prefix_cache_tokens=-1)
