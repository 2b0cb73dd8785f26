"""Shared builders for the data tests: a tiny trained tokenizer, images, trajectories."""

from __future__ import annotations

import functools
import json

import numpy as np

from osvl.data.tokenizer import Tokenizer, train_bpe_tokenizer
from osvl.rl.trajectory import FinishReason, Prompt, Step, ToolCall, ToolResult, Trajectory

CORPUS = [
    "The Kessock Bridge is a cable-stayed bridge in Inverness, Scotland. It opened in 1982.",
    "<think>I should search for the bridge name.</think>\n<tool_call>\n"
    '{"name": "text_search", "arguments": {"query": "cable-stayed bridge Inverness"}}\n</tool_call>',
    "<think>The answer is 1982.</think>\n<response>1982</response>",
    "search the web for images of the landmark and crop the region of interest",
    "Wikipedia: Inverness is a city in the Scottish Highlands. Population 47,790.",
] * 20

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "text_search",
            "description": "Search the web for a text query.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
    {
        "name": "crop",
        "description": "Crop a region of an image.",
        "parameters": {
            "type": "object",
            "properties": {"box": {"type": "array", "items": {"type": "number"}}},
            "required": ["box"],
        },
    },
]


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    return train_bpe_tokenizer(CORPUS, vocab_size=1024)


def rgb(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def engine_step(
    tok: Tokenizer,
    text: str,
    *,
    call: ToolCall | None = None,
    result: ToolResult | None = None,
    response: str | None = None,
    observation_images: list[np.ndarray] | None = None,
    stop_with_im_end: bool = False,
) -> Step:
    """A step as the engine would record it: the generated ids of ``text`` and fake logprobs."""
    ids = tok.encode(text) + ([tok.special.im_end] if stop_with_im_end else [])
    logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
    return Step(
        token_ids=ids,
        logprobs=logprobs,
        text=text,
        tool_call=call,
        tool_result=result,
        response=response,
        observation_text=result.text if result is not None else "",
        observation_images=observation_images or [],
    )


def search_trajectory(tok: Tokenizer, *, group_id: int = 0, sample_index: int = 0) -> Trajectory:
    """Two images in the prompt, a text search, an image-returning crop, then a response."""
    call1 = ToolCall("text_search", {"query": "cable-stayed bridge Inverness"})
    call2 = ToolCall("crop", {"box": [0, 0, 10, 10]})
    crop = rgb(40, 64, seed=3)
    steps = [
        engine_step(
            tok,
            "<think>search it</think>\n<tool_call>\n"
            + json.dumps({"name": call1.name, "arguments": call1.arguments})
            + "\n</tool_call>",
            call=call1,
            result=ToolResult(status="ok", tool="text_search", text="Kessock Bridge opened in 1982."),
        ),
        engine_step(
            tok,
            "<think>look closer</think>\n<tool_call>\n"
            + json.dumps({"name": call2.name, "arguments": call2.arguments})
            + "\n</tool_call>",
            call=call2,
            result=ToolResult(status="ok", tool="crop", text="", images=[crop]),
            observation_images=[crop],
        ),
        engine_step(tok, "<think>done</think>\n<response>1982</response>", response="1982", stop_with_im_end=True),
    ]
    prompt = Prompt(
        id="q0", question="When did this bridge open?", images=[rgb(64, 96, 1), rgb(50, 30, 2)], answer="1982"
    )
    return Trajectory(
        prompt=prompt, steps=steps, finish_reason=FinishReason.RESPONSE, group_id=group_id, sample_index=sample_index
    )
