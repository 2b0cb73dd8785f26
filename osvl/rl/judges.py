"""Judges for the accuracy reward ``r_acc`` and the query-quality reward ``r_query``: the verdict and
the two judge interfaces, and the LLM judges, which ask any OpenAI-compatible endpoint
(``osvl.rl.chat_client``; base URL, model and key from config). The offline judges for tests and the
demo are in ``osvl.rl.offline_judges`` (exact/alias match, a search-process heuristic) and
``osvl.rl.chain`` (the lookups a chain question asks for).

A judge never raises and never guesses: when it cannot produce a verdict (timeouts, 5xx or 429
past the retry budget, auth failures, malformed bodies, unparsable model output) it returns a
:class:`Verdict` with ``score=None`` and a reason, and the sample is excluded from its group.
With ``ChatJudgeConfig.overload_wait_s`` an endpoint's overload answers (429, 503) are back-pressure:
asked again (after its Retry-After) without using up attempts for that long, and only then unscored,
with the reason ``overloaded_http_<status>``; every verdict says how many it met (``overloads``).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

from osvl.rl.chat_client import ChatCompletionsClient
from osvl.rl.trajectory import Prompt, Step

# ---------------------------------------------------------------------------------------------
# Verdicts and judge interfaces


@dataclass(frozen=True)
class Verdict:
    """A judge's answer: ``score`` in [0, 1], or None with ``reason`` when it could not judge."""

    score: float | None
    reason: str = ""
    attempts: int = 0  # HTTP requests made (0 for offline judges)
    judge: str = ""  # which judge and prompt version produced it
    overloads: int = 0  # overload answers (429, 503) among the requests, waited out as back-pressure

    @property
    def scored(self) -> bool:
        return self.score is not None


class AccuracyJudge(Protocol):
    def judge_answer(self, prompt: Prompt, response: str) -> Verdict: ...


class QueryJudge(Protocol):
    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict: ...


def load_prompt(name: str) -> string.Template:
    """A versioned judge prompt from ``osvl/rl/prompts`` (``$name`` placeholders)."""
    text = resources.files("osvl.rl").joinpath("prompts", name).read_text(encoding="utf-8")
    return string.Template(text)


# ---------------------------------------------------------------------------------------------
# LLM judges


_VERDICT_LINE = re.compile(r"verdict\s*[:=]\s*\**\s*(correct|incorrect)\b", re.IGNORECASE)
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
QUERY_DIMENSIONS = ("relevance", "progression", "signal_to_noise", "cross_modal")


def parse_accuracy_verdict(text: str) -> float | None:
    """1.0 / 0.0 from the last ``verdict: correct|incorrect`` line, None if absent."""
    matches = _VERDICT_LINE.findall(text)
    if not matches:
        return None
    return 1.0 if matches[-1].lower() == "correct" else 0.0


def parse_query_scores(text: str) -> float | None:
    """Mean of the four 0-10 rubric scores in the last JSON object, scaled to [0, 1]."""
    for candidate in reversed(_JSON_OBJECT.findall(text)):
        try:
            scores = json.loads(candidate)
        except ValueError:
            continue
        if not isinstance(scores, dict):
            continue
        values = [scores.get(name) for name in QUERY_DIMENSIONS]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 10 for v in values):
            return sum(values) / (10.0 * len(values))
        return None
    return None


class LLMAccuracyJudge:
    """``r_acc`` from a chat model asked whether the response matches the reference."""

    def __init__(self, client: ChatCompletionsClient, prompt_file: str = "accuracy_judge.v1.txt") -> None:
        self.client = client
        self.template = load_prompt(prompt_file)
        self.name = f"chat:{client.config.model}:{prompt_file.removesuffix('.txt')}"

    def judge_answer(self, prompt: Prompt, response: str) -> Verdict:
        message = self.template.substitute(
            question=prompt.question, references="\n".join(f"- {a}" for a in prompt.accepted_answers), response=response
        )
        outcome = self.client.complete([{"role": "user", "content": message}])
        if outcome.text is None:
            return Verdict(None, outcome.error or "", outcome.attempts, self.name, outcome.overloads)
        score = parse_accuracy_verdict(outcome.text)
        if score is None:
            return Verdict(None, "unparsable_verdict", outcome.attempts, self.name, outcome.overloads)
        return Verdict(score, outcome.text[-200:], outcome.attempts, self.name, outcome.overloads)


def describe_calls(steps: Sequence[Step], excerpt_chars: int = 400) -> str:
    """Numbered, human-readable list of the tool calls in ``steps`` for the query judge."""
    lines = []
    for step in steps:
        result = step.tool_result
        if step.tool_call is None and result is None:
            continue
        if step.tool_call is not None:
            action = f"{step.tool_call.name} {json.dumps(step.tool_call.arguments, ensure_ascii=False)}"
        else:
            action = "(unparsable action)"
        if result is None:
            outcome = "not executed"
        elif result.ok:
            shown = result.text[:excerpt_chars] + ("..." if len(result.text) > excerpt_chars else "")
            images = f" [+{len(result.images)} image(s)]" if result.images else ""
            outcome = f"ok: {shown}{images}"
        else:
            outcome = f"{result.status.value}: {result.error or ''}"
        lines.append(f"{len(lines) + 1}. {action} -> {outcome}")
    return "\n".join(lines)


class LLMQueryJudge:
    """``r_query`` from a chat model scoring the search process on the four-dimension rubric."""

    def __init__(
        self, client: ChatCompletionsClient, prompt_file: str = "query_judge.v1.txt", excerpt_chars: int = 400
    ) -> None:
        self.client = client
        self.template = load_prompt(prompt_file)
        self.excerpt_chars = excerpt_chars
        self.name = f"chat:{client.config.model}:{prompt_file.removesuffix('.txt')}"

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        message = self.template.substitute(question=prompt.question, calls=describe_calls(steps, self.excerpt_chars))
        outcome = self.client.complete([{"role": "user", "content": message}])
        if outcome.text is None:
            return Verdict(None, outcome.error or "", outcome.attempts, self.name, outcome.overloads)
        score = parse_query_scores(outcome.text)
        if score is None:
            return Verdict(None, "unparsable_verdict", outcome.attempts, self.name, outcome.overloads)
        return Verdict(score, outcome.text[-200:], outcome.attempts, self.name, outcome.overloads)
