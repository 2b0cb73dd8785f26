"""Small builders for trajectory records used across the rl tests."""

from __future__ import annotations

import json

import numpy as np

from osvl.rl.trajectory import FinishReason, Prompt, Step, ToolCall, ToolResult, Trajectory

PROMPT = Prompt(
    id="p0",
    question="In what year did the bridge shown in this photo open?",
    answer="1982",
    aliases=["nineteen eighty-two"],
)


def tool_step(
    status: str | None = "ok",
    name: str = "text_search",
    arguments: dict | None = None,
    observation: str = "Kessock Bridge opened in 1982.",
    text: str | None = None,
) -> Step:
    """A well-formed tool-call step whose execution ended with ``status``."""
    arguments = {"query": "Kessock Bridge opening year"} if arguments is None else arguments
    call = f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
    result = (
        None
        if status is None
        else ToolResult(
            status=status,
            tool=name,
            text=observation if status == "ok" else "",
            error=None if status == "ok" else f"{status} happened",
        )
    )
    return Step(
        token_ids=[1, 2, 3],
        logprobs=[-0.1, -0.2, -0.3],
        text=text if text is not None else f"<think>look it up</think>\n{call}",
        think="look it up",
        tool_call=ToolCall(name, arguments),
        tool_result=result,
        observation_text=result.text if result else "",
    )


def response_step(answer: str = "1982") -> Step:
    return Step(
        token_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        text=f"<think>done</think>\n<response>{answer}</response>",
        think="done",
        response=answer,
    )


def trajectory(
    statuses: list[str],
    answer: str | None = "1982",
    group_id: int = 0,
    sample_index: int = 0,
    finish: FinishReason | None = None,
) -> Trajectory:
    """Tool steps with the given statuses, then a response step unless ``answer`` is None."""
    steps = [tool_step(s) for s in statuses]
    if answer is not None:
        steps.append(response_step(answer))
    reason = finish or (FinishReason.RESPONSE if answer is not None else FinishReason.MAX_TURNS)
    return Trajectory(prompt=PROMPT, steps=steps, finish_reason=reason, group_id=group_id, sample_index=sample_index)


def rgb(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


ZOO_QUESTION = "What is the occupation of the founder of the zoo shown in the image?"


def zoo_chain_steps() -> tuple[Step, Step]:
    """The first two lookups of :data:`ZOO_QUESTION`'s 2-hop chain, each on the entity its evidence names: the
    image search's top match (Jorzel Zoo), then its founder (whose passage names Jorlo Talcor)."""
    match = "[Match 1] Jorzel Zoo (page: Jorzel_Zoo; near_duplicate, score 1)\nCaption: Jorzel Zoo, a zoo"
    passage = "[Passage 1] Jorzel Zoo\nURL: world://Jorzel_Zoo\nSummary: The founder of Jorzel Zoo is Jorlo Talcor."
    image = tool_step("ok", name="image_search", arguments={"image": 0, "top_k": 1}, observation=match)
    founder = tool_step("ok", arguments={"query": "Jorzel Zoo founder"}, observation=passage)
    return image, founder
