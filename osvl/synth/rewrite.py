"""Canonical question and fuzzy entity rewriting (Sec. 3.1, Eq. 6).

Rewriting goes one entity at a time from the answer node and the farthest bridge toward v0. A
candidate descriptor is accepted only when (Eq. 6) the answer is unchanged, the rewritten mention
still denotes exactly its entity given the partially rewritten question, and the question
contains no surface form (title, alias, redirect) of any rewritten node. The first accepted
candidate wins; candidates of equal complexity come in random order (ties broken at random).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Protocol

from osvl.synth.question import (
    Attr,
    GraphFacts,
    Mention,
    Question,
    Rel,
    Resolver,
    leaked_forms,
    obfuscate,
    render_question,
)
from osvl.synth.sampling import SampledPath
from osvl.world.graph import Graph


def canonical_question(graph: Graph, path: SampledPath) -> Question:
    """Every node named, each linked to its predecessor by the path relation."""
    mentions = [Mention(name=graph[path.nodes[0]].title, noun=graph[path.nodes[0]].kind)]
    for index in range(1, len(path.nodes)):
        page = graph[path.nodes[index]]
        mentions.append(
            Mention(name=page.title, noun=page.kind, constraints=(Rel(path.relations[index - 1], index - 1),))
        )
    return Question(tuple(mentions), path.attribute)


@dataclass(frozen=True)
class UniquenessVerdict:
    accepted: bool
    reason: str  # "ok" | "not_unique" | "answer_changed" | "leak" | an evaluator error
    compatible: tuple[str, ...] = ()  # entities the rewritten mention may denote
    answers: tuple[str, ...] = ()


class DescriptorProposer(Protocol):
    def propose(self, question: Question, path: SampledPath, index: int) -> list[Mention]: ...


class UniquenessEvaluator(Protocol):
    def evaluate(self, question: Question, path: SampledPath, index: int, answer: str) -> UniquenessVerdict: ...


@dataclass
class GraphDescriptorProposer:
    """Descriptors from the entity's own context: the path relation to its predecessor, then that
    relation plus one or two infobox qualifiers, simplest first."""

    graph: Graph
    rng: random.Random
    max_qualifiers: int = 2

    def propose(self, question: Question, path: SampledPath, index: int) -> list[Mention]:
        page = self.graph[path.nodes[index]]
        link = Rel(path.relations[index - 1], index - 1)
        qualifiers = [
            Attr(k, v)
            for k, v in sorted(page.infobox.items())
            if not (index == len(path.nodes) - 1 and k == path.attribute)
        ]
        candidates = [Mention(noun=page.kind, constraints=(link,))]
        for size in range(1, self.max_qualifiers + 1):
            group = [
                Mention(noun=page.kind, constraints=(link, *combo))
                for combo in itertools.combinations(qualifiers, size)
            ]
            self.rng.shuffle(group)
            candidates += group
        return candidates


@dataclass
class ExactGraphEvaluator:
    """Eq. 6 decided by resolving the structured question over the whole closed world."""

    graph: Graph
    _resolver: Resolver = field(init=False)

    def __post_init__(self) -> None:
        self._resolver = Resolver(GraphFacts(self.graph))

    def evaluate(self, question: Question, path: SampledPath, index: int, answer: str) -> UniquenessVerdict:
        compatible = self._resolver.resolve(question, index)
        answers = self._resolver.answers(question)
        target = self._resolver.resolve(question, len(question.mentions) - 1)
        if compatible != {path.nodes[index]} or len(target) != 1:
            return UniquenessVerdict(False, "not_unique", tuple(sorted(compatible)), tuple(sorted(answers)))
        if answers != {answer}:
            return UniquenessVerdict(False, "answer_changed", tuple(sorted(compatible)), tuple(sorted(answers)))
        return UniquenessVerdict(True, "ok", tuple(sorted(compatible)), tuple(sorted(answers)))


@dataclass
class RewriteLog:
    node: str
    candidate: str  # the rewritten question text
    verdict: str


@dataclass
class RewriteResult:
    question: Question | None
    answer: str
    log: list[RewriteLog]
    reason: str  # "ok" or why rewriting failed


def path_forms(graph: Graph, path: SampledPath, indices: range) -> list[str]:
    return [form for i in indices for form in graph.surface_forms(path.nodes[i])]


def rewrite(
    graph: Graph,
    path: SampledPath,
    proposer: DescriptorProposer,
    evaluator: UniquenessEvaluator,
    rng: random.Random,
    obfuscate_prob: float = 0.0,
) -> RewriteResult:
    """Fuzzy-rewrite nodes ``h .. 1`` of the canonical question; v0 is left for anchor grounding."""
    question = canonical_question(graph, path)
    answer, log = path.answer, []
    last = len(path.nodes) - 1
    for index in range(last, 0, -1):
        banned = path_forms(graph, path, range(index, last + 1))
        for candidate in proposer.propose(question, path, index):
            trial = question.with_mention(index, candidate)
            text = render_question(trial)
            if leaked_forms(text, banned):
                log.append(RewriteLog(path.nodes[index], text, "leak"))
                continue
            verdict = evaluator.evaluate(trial, path, index, answer)
            log.append(RewriteLog(path.nodes[index], text, verdict.reason))
            if verdict.accepted:
                question = trial
                break
        else:
            return RewriteResult(None, answer, log, f"no_unique_descriptor:{index}")
    if obfuscate_prob > 0 and rng.random() < obfuscate_prob:
        for kind in ("year", "nearest_ten"):
            hidden = obfuscate(answer, kind)
            if hidden is None:
                continue
            trial = Question(question.mentions, question.attribute, kind)
            verdict = evaluator.evaluate(trial, path, 1, hidden)
            log.append(RewriteLog(path.nodes[last], render_question(trial), f"obfuscate:{verdict.reason}"))
            if verdict.accepted:
                question, answer = trial, hidden
            break
    return RewriteResult(question, answer, log, "ok")
