"""Scripted turns for forced decoding: turn n of a rollout replays ``turns[n]``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from osvl.rollout.engine import GenerationRequest
from tests.rollout.helpers import tokenizer


def call(name: str, **arguments) -> str:
    return (
        f"<think>use {name}</think>\n<tool_call>\n"
        + json.dumps({"name": name, "arguments": arguments})
        + "\n</tool_call>"
    )


def respond(answer: str = "1982") -> str:
    return f"<think>Done.</think>\n<response>{answer}</response>"


def scripted(turns: Sequence[str]) -> Callable[[GenerationRequest], list[int]]:
    tok = tokenizer()
    header = tok.encode("<|im_start|>assistant\n")

    def script(request: GenerationRequest) -> list[int]:
        ids = request.input_ids
        turn = sum(ids[i : i + len(header)] == header for i in range(len(ids))) - 1
        return tok.encode(turns[min(turn, len(turns) - 1)])

    return script
