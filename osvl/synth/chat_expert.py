"""Trajectory synthesis with an OpenAI-compatible expert model (Sec. 3.2: a frontier model).

The expert sees the question image and the tool schemas, and answers in the agent's action
format (``<think>`` then one ``<tool_call>{json}</tool_call>`` or ``<response>``, read by the
rollout parser, so SFT text and RL rollouts share one grammar). Tool calls run through a
:data:`ToolExecutor` (the real tool environment in production), observations go back as the
next user turn, and the episode ends on a response, the turn budget, a fatal tool-error cascade
(K consecutive policy errors, as in RL) or an expert outage. Only episodes that ended with a
response reach the judges; the rest are counted as incomplete, never written.
"""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from osvl.rl.actions import parse_action
from osvl.rl.chat_client import ChatCompletionsClient
from osvl.rl.fatal import FatalConfig, find_fatal_step
from osvl.rl.trajectory import FinishReason, Step, ToolResult, ToolStatus
from osvl.synth.expert import ToolExecutor
from osvl.synth.records import QAItem
from osvl.tools.errors import CallParseError, ToolError, error_status
from osvl.tools.image_io import encode_png
from osvl.tools.limits import ToolLimits
from osvl.tools.registry import parse_tool_call

EXPERT_PROMPT_V1 = """You are an expert research agent. Answer the user's question about the image \
by searching step by step with the tools below. Image 0 is the question image; images returned by \
tools get the next indices.

Tools (JSON schema):
{tools}

Every turn, first reason inside <think>...</think>, then either call exactly one tool as
<tool_call>{{"name": "<tool>", "arguments": {{...}}}}</tool_call>
or, once you are sure, give a short final answer as <response>...</response>.
Tool results come back as <tool_response>...</tool_response>."""


@dataclass(frozen=True)
class ChatExpertConfig:
    max_turns: int = 12
    fatal: FatalConfig = field(default_factory=FatalConfig)
    send_images: bool = True  # attach images as data URLs (a vision-capable expert)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"ChatExpertConfig.max_turns must be >= 1, got {self.max_turns}")


@dataclass
class ExpertEpisode:
    steps: list[Step]
    finish: FinishReason
    error: str | None = None  # the client's error code when the expert was unreachable


def image_content_part(image: np.ndarray) -> dict[str, Any]:
    data = base64.b64encode(encode_png(image)).decode("ascii")
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


@dataclass
class ChatExpert:
    client: ChatCompletionsClient
    tools: ToolExecutor
    tool_schemas: list[dict[str, Any]]  # what the system prompt lists (the tools ``tools`` runs)
    config: ChatExpertConfig = field(default_factory=ChatExpertConfig)
    limits: ToolLimits = field(default_factory=ToolLimits)

    def _user(self, text: str, images: list[np.ndarray]) -> dict[str, Any]:
        if not (self.config.send_images and images):
            return {"role": "user", "content": text}
        return {"role": "user", "content": [{"type": "text", "text": text}, *map(image_content_part, images)]}

    def episode(self, question: str, image: np.ndarray) -> ExpertEpisode:
        system = EXPERT_PROMPT_V1.format(tools=json.dumps(self.tool_schemas, ensure_ascii=False, indent=1))
        messages = [{"role": "system", "content": system}, self._user(question, [image])]
        images, steps = [image], []
        for _ in range(self.config.max_turns):
            outcome = self.client.complete(messages)
            if outcome.text is None:
                return ExpertEpisode(steps, FinishReason.INFRA_ERROR, outcome.error)
            action = parse_action(outcome.text)
            messages.append({"role": "assistant", "content": outcome.text})
            if action.response is not None:
                steps.append(
                    Step(token_ids=[], logprobs=[], text=outcome.text, think=action.think, response=action.response)
                )
                return ExpertEpisode(steps, FinishReason.RESPONSE)
            call, result = None, ToolResult(ToolStatus.PARSE_ERROR, "", error=action.error)
            if action.error is None:
                try:
                    call = parse_tool_call(action.call, self.limits)
                except (CallParseError, ToolError) as error:  # e.g. a 4300-digit number: typed, not a crash
                    result = ToolResult(error_status(error), "", error=str(error))
                else:
                    result = self.tools(call, images)
            produced = list(result.images) if result.ok else []
            images.extend(produced)
            steps.append(
                Step(
                    token_ids=[],
                    logprobs=[],
                    text=outcome.text,
                    think=action.think,
                    tool_call=call,
                    tool_result=result,
                    observation_text=result.observation,
                    observation_images=produced,
                )
            )
            if (
                find_fatal_step(
                    [s.status for s in steps], self.config.fatal.k, self.config.fatal.anchor, self.config.fatal.errors
                )
                != -1
            ):
                return ExpertEpisode(steps, FinishReason.FATAL)
            messages.append(self._user(f"<tool_response>\n{result.observation}\n</tool_response>", produced))
        return ExpertEpisode(steps, FinishReason.MAX_TURNS)

    def rollout(self, item: QAItem, image: np.ndarray, rng: random.Random) -> list[Step]:
        """The synthesis interface; sampling diversity comes from the server's temperature."""
        return self.episode(item.text, image).steps
