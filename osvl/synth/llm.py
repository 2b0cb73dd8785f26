"""LLM back-ends for rewriting, over any OpenAI-compatible chat endpoint (open worlds, real Wikipedia).

The proposer asks for descriptors of one entity drawn from its page; the evaluator asks which
entities a rewritten mention could denote given the partially rewritten question, and what the
question's answer is. Transport failures never raise: the proposer returns no candidates and the
evaluator rejects with the client's error code, so the seed is retried or dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from osvl.rl.chat_client import ChatCompletionsClient
from osvl.rl.offline_judges import normalize_answer
from osvl.synth.question import Mention, Question, render_mention, render_question
from osvl.synth.rewrite import UniquenessVerdict
from osvl.synth.sampling import SampledPath
from osvl.world.graph import Graph

PROPOSER_PROMPT_V1 = """You rewrite entity names into fuzzy but unique descriptors.
Entity: {title}
Its page: {context}
It is the "{relation}" of the previous entity, written {{prev}}.
Propose up to {n} descriptors that identify this entity through {{prev}} plus facts from its page,
without ever using its name or aliases ({forms}).
Reply with JSON only: {{"descriptors": ["the ... of {{prev}} ...", ...]}}"""

EVALUATOR_PROMPT_V1 = """Question: {question}
Consider the phrase "{phrase}" inside the question. List every entity it could refer to given the
rest of the question, and answer the question.
Reply with JSON only: {{"compatible": ["entity name", ...], "answer": "short answer"}}"""

_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def last_json_object(text: str) -> dict | None:
    """The outermost JSON object in a model reply (code fences and chatter tolerated)."""
    match = _JSON_OBJECT.search(text)
    if match is None:
        return None
    try:
        value = json.loads(match.group(0))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class LLMDescriptorProposer:
    client: ChatCompletionsClient
    graph: Graph
    page_context: Callable[[str], str]  # page id -> text shown to the model (lead + infobox)
    max_candidates: int = 3
    last_error: str | None = None

    def propose(self, question: Question, path: SampledPath, index: int) -> list[Mention]:
        page = self.graph[path.nodes[index]]
        prompt = PROPOSER_PROMPT_V1.format(
            title=page.title,
            context=self.page_context(page.id),
            relation=path.relations[index - 1],
            n=self.max_candidates,
            forms=", ".join(self.graph.surface_forms(page.id)),
        )
        outcome = self.client.complete([{"role": "user", "content": prompt}])
        if outcome.text is None:
            self.last_error = outcome.error
            return []
        reply = last_json_object(outcome.text)
        descriptors = reply.get("descriptors") if reply else None
        if not isinstance(descriptors, list):
            self.last_error = "unparsable_descriptors"
            return []
        self.last_error = None
        return [
            Mention(noun=page.kind, text=d)
            for d in descriptors[: self.max_candidates]
            if isinstance(d, str) and d.strip()
        ]


@dataclass
class LLMUniquenessEvaluator:
    client: ChatCompletionsClient
    graph: Graph

    def evaluate(self, question: Question, path: SampledPath, index: int, answer: str) -> UniquenessVerdict:
        prompt = EVALUATOR_PROMPT_V1.format(question=render_question(question), phrase=render_mention(question, index))
        outcome = self.client.complete([{"role": "user", "content": prompt}])
        if outcome.text is None:
            return UniquenessVerdict(False, outcome.error or "no_reply")
        reply = last_json_object(outcome.text)
        compatible, said = (reply or {}).get("compatible"), (reply or {}).get("answer")
        if not isinstance(compatible, list) or not isinstance(said, str):
            return UniquenessVerdict(False, "unparsable_verdict")
        names = tuple(str(c) for c in compatible)
        intended = {normalize_answer(f) for f in self.graph.surface_forms(path.nodes[index])}
        if len(names) != 1 or normalize_answer(names[0]) not in intended:
            return UniquenessVerdict(False, "not_unique", names, (said,))
        if normalize_answer(said) != normalize_answer(answer):
            return UniquenessVerdict(False, "answer_changed", names, (said,))
        return UniquenessVerdict(True, "ok", names, (said,))
