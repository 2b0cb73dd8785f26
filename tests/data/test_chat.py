"""Chat rendering: round trip, verbatim engine ids, loss mask, steps, image order, tool schema."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from osvl.data.chat import ChatRenderer, TrajectoryImages, function_schema, system_text
from osvl.data.image import DeferredImage, ImageConfig, process_image
from osvl.data.mrope import mrope_position_ids
from osvl.data.tokenizer import Tokenizer
from osvl.rl.trajectory import FinishReason, Prompt, Trajectory
from tests.data.helpers import TOOLS, engine_step, rgb, search_trajectory, tiny_tokenizer

IMAGES = ImageConfig(min_pixels=32 * 32, max_pixels=32 * 32 * 8)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(tiny_tokenizer(), IMAGES, tools=TOOLS, system_prompt="You are a search agent.")


def image_text(image: np.ndarray) -> str:
    return "<|vision_start|>" + "<|image_pad|>" * process_image(image, IMAGES).num_tokens + "<|vision_end|>"


def test_system_turn_is_qwen3_tool_format():
    text = system_text(TOOLS[:1], "Be brief.")
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOLS[0], ensure_ascii=False)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
    )
    assert system_text([], "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert system_text([]) == ""


def test_bare_function_schema_is_wrapped():
    wrapped = function_schema(TOOLS[1])
    assert wrapped == {"type": "function", "function": TOOLS[1]}
    assert function_schema(wrapped) == wrapped
    assert function_schema({"name": "noop"})["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "tools, match",
    [
        (["text_search"], "must be a dict"),
        ([{"description": "nameless"}], "non-empty 'name'"),
        ([{"name": "x", "parameters": "a string"}], "parameters"),
        ([{"type": "retrieval"}], "OpenAI function tool"),
        ([{"name": "x"}, {"type": "function", "function": {"name": "x"}}], "duplicate tool names"),
    ],
)
def test_bad_tool_schemas_raise(tools, match):
    with pytest.raises(ValueError, match=match):
        system_text(tools)


def test_round_trip_decodes_to_the_conversation(renderer):
    tok = renderer.tokenizer
    traj = search_trajectory(tok)
    rendered = renderer.render_trajectory(traj)
    prompt, steps = traj.prompt, traj.steps
    expected = (
        renderer.system
        + "<|im_start|>user\n"
        + image_text(prompt.images[0])
        + image_text(prompt.images[1])
        + prompt.question
        + "<|im_end|>\n<|im_start|>assistant\n"
        + steps[0].text
        + "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        + steps[0].observation_text
        + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        + steps[1].text
        + "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        + image_text(steps[1].observation_images[0])
        + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        + steps[2].text
        + "<|im_end|>"
    )
    assert tok.decode(rendered.input_ids.tolist()) == expected
    assert renderer.system.startswith("<|im_start|>system\nYou are a search agent.\n\n# Tools")


def test_loss_mask_covers_exactly_the_engine_tokens(renderer):
    traj = search_trajectory(renderer.tokenizer)
    rendered = renderer.render_trajectory(traj)
    generated = [t for step in traj.steps for t in step.token_ids]
    assert rendered.input_ids[rendered.loss_mask].tolist() == generated
    assert rendered.token_step[rendered.loss_mask].tolist() == [
        i for i, step in enumerate(traj.steps) for _ in step.token_ids
    ]
    np.testing.assert_array_equal(
        rendered.logprobs[rendered.loss_mask], np.asarray([lp for s in traj.steps for lp in s.logprobs], np.float32)
    )
    assert (rendered.logprobs[~rendered.loss_mask] == 0).all()
    # one contiguous run per step: template scaffolding and observations are never policy tokens
    edges = np.flatnonzero(np.diff(rendered.loss_mask.astype(np.int8)) != 0)
    assert len(edges) == 2 * len(traj.steps) - 1 and rendered.loss_mask[-1]
    # the <|im_end|> the engine did not generate (after </tool_call>) is masked; the one it did is not
    im_end = renderer.tokenizer.special.im_end
    assert not rendered.loss_mask[(rendered.input_ids == im_end)][:-1].any()
    assert rendered.input_ids[-1] == im_end and rendered.loss_mask[-1]


def test_steps_are_monotone_and_observations_belong_to_their_step(renderer):
    rendered = renderer.render_trajectory(search_trajectory(renderer.tokenizer))
    assert (np.diff(rendered.token_step) >= 0).all()
    assert rendered.token_step[0] == 0 and rendered.token_step[-1] == 2
    assert rendered.input_ids.dtype == np.int64 and rendered.token_step.dtype == np.int64


def test_images_in_order_prompt_then_tools(renderer):
    traj = search_trajectory(renderer.tokenizer)
    rendered = renderer.render_trajectory(traj)
    originals = traj.prompt.images + traj.steps[1].observation_images
    assert len(rendered.images) == 3
    for ours, original in zip(rendered.images, originals):
        assert np.array_equal(ours.pixels, process_image(original, IMAGES).pixels)
    # each pad run lines up with its image's grid, in order
    mrope_position_ids(
        rendered.input_ids,
        [p.grid_thw for p in rendered.images],
        renderer.tokenizer.special.image_pad,
        IMAGES.merge_size,
    )


def test_engine_ids_are_kept_verbatim_even_when_they_would_tokenize_differently(renderer):
    tok = renderer.tokenizer
    traj = search_trajectory(tok)
    by_byte = [tok.backend.token_to_id(c) for c in "search"]  # the engine sampled one byte at a time
    odd = [tok.special.think_start, *by_byte, tok.special.think_end] + tok.encode("\n<response>x</response>")
    assert tok.encode(tok.decode(odd)) != odd
    traj.steps[-1].token_ids = odd
    traj.steps[-1].logprobs = [-1.0] * len(odd)
    rendered = renderer.render_trajectory(traj)
    assert rendered.input_ids[rendered.loss_mask].tolist()[-len(odd) :] == odd
    assert rendered.input_ids[-len(odd) :].tolist() == odd


def test_prompt_render_is_the_prefix_of_the_trajectory(renderer):
    traj = search_trajectory(renderer.tokenizer)
    prompt = renderer.render_prompt(traj.prompt)
    rendered = renderer.render_trajectory(traj)
    assert rendered.input_ids[: len(prompt.ids)].tolist() == prompt.ids
    assert renderer.tokenizer.decode(prompt.ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(prompt.images) == 2


def test_recorded_observation_ids_are_spliced_verbatim(renderer):
    tok = renderer.tokenizer
    traj = search_trajectory(tok)
    recorded = tok.encode(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nrecorded by the loop"
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    traj.steps[0].observation_token_ids = recorded
    rendered = renderer.render_trajectory(traj)
    start = len(renderer.render_prompt(traj.prompt).ids) + len(traj.steps[0].token_ids)
    assert rendered.input_ids[start : start + len(recorded)].tolist() == recorded


def test_recorded_observation_with_wrong_image_tokens_raises(renderer):
    tok = renderer.tokenizer
    traj = search_trajectory(tok)
    traj.steps[1].observation_token_ids = tok.encode("<|im_end|>\n<|vision_start|><|image_pad|><|vision_end|>")
    with pytest.raises(ValueError, match="step 1: recorded observation has 1 image tokens"):
        renderer.render_trajectory(traj)


def test_policy_generated_image_pad_raises(renderer):
    tok = renderer.tokenizer
    traj = search_trajectory(tok)
    traj.steps[0].token_ids = traj.steps[0].token_ids + [tok.special.image_pad]
    traj.steps[0].logprobs = traj.steps[0].logprobs + [-1.0]
    with pytest.raises(ValueError, match="image tokens in the ids"):
        renderer.render_trajectory(traj)


def test_out_of_vocab_engine_ids_raise(renderer):
    traj = search_trajectory(renderer.tokenizer)
    traj.steps[0].token_ids = [renderer.tokenizer.vocab_size + 5]
    traj.steps[0].logprobs = [-1.0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        renderer.render_trajectory(traj)


def test_text_only_single_step_trajectory(renderer):
    tok = renderer.tokenizer
    step = engine_step(tok, "<think>easy</think>\n<response>Paris</response>", response="Paris")
    traj = Trajectory(
        prompt=Prompt(id="t", question="Capital of France?"),
        steps=[step],
        finish_reason=FinishReason.RESPONSE,
        group_id=1,
        sample_index=0,
    )
    rendered = renderer.render_trajectory(traj)
    assert rendered.images == [] and rendered.input_ids[rendered.loss_mask].tolist() == step.token_ids
    assert tok.decode(rendered.input_ids.tolist()).endswith("<|im_start|>assistant\n" + step.text)


def test_rendering_does_not_mutate_the_trajectory(renderer):
    traj = search_trajectory(renderer.tokenizer)
    before = copy.deepcopy([(s.token_ids, s.observation_token_ids) for s in traj.steps])
    renderer.render_trajectory(traj)
    assert [(s.token_ids, s.observation_token_ids) for s in traj.steps] == before


def test_bad_prompt_image_raises(renderer):
    prompt = Prompt(id="x", question="?", images=[rgb(4, 4, 0)])
    prompt.images.append(np.zeros((0, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="H, W > 0"):
        renderer.render_prompt(prompt)


def deferred_images(traj: Trajectory) -> TrajectoryImages:
    """The trajectory's images as ready processed ones; a deferred image only has to count its tokens."""

    def defer(image: np.ndarray) -> DeferredImage:
        processed = process_image(image, IMAGES)
        return DeferredImage(processed.grid_thw, processed.num_tokens, lambda: processed)

    return TrajectoryImages(
        [defer(i) for i in traj.prompt.images], [[defer(i) for i in step.observation_images] for step in traj.steps]
    )


@pytest.mark.parametrize("recorded", [False, True])
def test_given_images_render_as_the_trajectory_own(renderer, recorded):
    traj = search_trajectory(renderer.tokenizer)
    if recorded:  # the agent loop's ids, with the image's pad run
        traj.steps[1].observation_token_ids = renderer.render_observation(traj.steps[1]).ids
    given = deferred_images(traj)
    bare = copy.deepcopy(traj)
    bare.prompt.images, bare.steps[1].observation_images = [], []  # e.g. read with store=None
    eager, deferred = renderer.render_trajectory(traj), renderer.render_trajectory(bare, given)
    assert np.array_equal(eager.input_ids, deferred.input_ids) and np.array_equal(eager.loss_mask, deferred.loss_mask)
    assert np.array_equal(eager.token_step, deferred.token_step)
    assert deferred.images == [*given.prompt, *given.observations[1]]
    assert [p.grid_thw for p in eager.images] == [p.grid_thw for p in deferred.images]


def test_given_images_must_fit_the_trajectory(renderer):
    traj = search_trajectory(renderer.tokenizer)
    given = deferred_images(traj)
    with pytest.raises(ValueError, match="images for 2 observations, 3 steps"):
        renderer.render_trajectory(traj, TrajectoryImages(given.prompt, given.observations[:2]))
    with pytest.raises(ValueError, match="1 processed images given for 2 images"):
        renderer.render_trajectory(traj, TrajectoryImages(given.prompt[:1], given.observations))


def test_with_tokenizer_renders_the_same_prompt_through_another_tokenizer(renderer):
    counted = []

    class Counting(Tokenizer):
        def encode(self, text):
            counted.append(text)
            return super().encode(text)

    other = renderer.with_tokenizer(Counting(renderer.tokenizer.backend))
    traj = search_trajectory(renderer.tokenizer)
    assert np.array_equal(other.render_trajectory(traj).input_ids, renderer.render_trajectory(traj).input_ids)
    assert counted and other.system == renderer.system and renderer.tokenizer is not other.tokenizer
