"""Answer-equivalence judges for Pass@1: a GPT-4o-style chat judge and an offline normalized match.

The chat judge's prompt is a versioned file in ``osvl/eval/prompts``; its name is part of every
verdict's ``judge`` field, so numbers from different prompt versions never mix silently. A judge
outage (timeouts, 5xx past the retry budget, malformed bodies, unparsable output) gives an
unscored verdict: the item is reported as unjudged and left out of Pass@1, never counted wrong.
A missing answer, by contrast, is the model's failure and scores 0 without asking anyone.
"""

from __future__ import annotations

import string
from importlib import resources
from typing import Protocol

from osvl.eval.items import EvalItem
from osvl.rl.chat_client import ChatCompletionsClient
from osvl.rl.judges import Verdict, parse_accuracy_verdict
from osvl.rl.offline_judges import normalize_answer

DEFAULT_PROMPT = "equivalence_judge.v1.txt"


class AnswerJudge(Protocol):
    name: str

    def judge(self, item: EvalItem, answer: str | None) -> Verdict: ...


def load_prompt(name: str) -> string.Template:
    """A versioned prompt from ``osvl/eval/prompts`` with ``$question``/``$references``/``$response``."""
    file = resources.files("osvl.eval").joinpath("prompts", name)
    if not file.is_file():
        raise ValueError(f"no judge prompt {name!r} in osvl/eval/prompts")
    return string.Template(file.read_text(encoding="utf-8"))


def no_answer(judge: str) -> Verdict:
    return Verdict(0.0, "no_answer", 0, judge)


class EquivalenceJudge:
    """Asks a chat model whether the answer names the same fact as any reference form."""

    def __init__(self, client: ChatCompletionsClient, prompt_file: str = DEFAULT_PROMPT) -> None:
        self.client = client
        self.template = load_prompt(prompt_file)
        self.name = f"chat:{client.config.model}:{prompt_file.removesuffix('.txt')}"

    def judge(self, item: EvalItem, answer: str | None) -> Verdict:
        if answer is None or not answer.strip():
            return no_answer(self.name)
        message = self.template.substitute(
            question=item.question, references="\n".join(f"- {a}" for a in item.answers), response=answer.strip()
        )
        outcome = self.client.complete([{"role": "user", "content": message}])
        if outcome.text is None:
            return Verdict(None, outcome.error or "judge_error", outcome.attempts, self.name)
        score = parse_accuracy_verdict(outcome.text)
        if score is None:
            return Verdict(None, "unparsable_verdict", outcome.attempts, self.name)
        return Verdict(score, outcome.text[-200:], outcome.attempts, self.name)


class NormalizedMatchJudge:
    """Offline: correct when the normalized answer equals a normalized reference form."""

    name = "offline:normalized_match"

    def judge(self, item: EvalItem, answer: str | None) -> Verdict:
        if answer is None or not answer.strip():
            return no_answer(self.name)
        accepted = {normalize_answer(a) for a in item.answers} - {""}
        hit = normalize_answer(answer) in accepted
        return Verdict(1.0 if hit else 0.0, "match" if hit else "no match", 0, self.name)
