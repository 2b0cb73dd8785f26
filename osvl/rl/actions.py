"""The action grammar of one assistant step: ``<think>..</think>`` then exactly one
``<tool_call>{json}</tool_call>`` or ``<response>..</response>``.

One parser for every place that reads assistant text: the rollout agent loop, the curation
experts, evaluation and the readers of outside SFT data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_RESPONSE = re.compile(r"<response>(.*?)</response>", re.DOTALL)


@dataclass
class Action:
    """What one generation asks for: exactly one of a tool call, a response, or an error."""

    think: str | None = None
    call: str | None = None  # raw JSON between <tool_call> tags
    response: str | None = None
    error: str | None = None


def parse_action(text: str) -> Action:
    """Reads ``<think>..</think>`` then one ``<tool_call>{json}</tool_call>`` or ``<response>..</response>``."""
    think = _THINK.search(text)
    calls = _CALL.findall(text)
    responses = _RESPONSE.findall(text)
    action = Action(think=think.group(1).strip() if think else None)
    if len(calls) + len(responses) == 0:
        action.error = "no action: end the turn with <tool_call>{...}</tool_call> or <response>...</response>"
    elif len(calls) + len(responses) > 1:
        action.error = "more than one action in one turn; emit a single <tool_call> or <response>"
    elif calls:
        action.call = calls[0].strip()
    else:
        action.response = responses[0].strip()
    return action
