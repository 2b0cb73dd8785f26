"""Staged difficulty filtering (Sec. 3.2) through pluggable solvers.

Stage 1 drops items a solver answers with no tools; stage 2 drops items it answers with one
ImageSearch call. The rollout engine implements :class:`Solver` with a frozen VLM; offline, the
exact solvers below model a knowledgeable reader: it knows every fact among "famous" entities
(in-degree at least ``fame_in_degree``, the closed-world stand-in for parametric knowledge) and
exactly what its tool calls returned. Solver calls are cached and budgeted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from osvl.jsonl import iter_jsonl
from osvl.rl.offline_judges import normalize_answer
from osvl.synth.question import Rel, Resolver, name_index, obfuscate
from osvl.synth.records import Drop, QAItem
from osvl.world.build import ImageRecord
from osvl.world.graph import Graph


@dataclass(frozen=True)
class SolverAnswer:
    answer: str | None  # None: the solver could not commit to one answer
    tool_calls: int = 0


class Solver(Protocol):
    name: str

    def solve(self, item: QAItem) -> SolverAnswer: ...


class BudgetExhausted(RuntimeError):
    """The stage stops; what was decided so far is on disk and a later run resumes."""


@dataclass
class KnownFacts:
    """The facts a solver has: those among famous entities plus what its tools returned."""

    graph: Graph
    famous: frozenset[str]
    edges: set[tuple[str, str, str]] = field(default_factory=set)
    attributes: set[tuple[str, str]] = field(default_factory=set)

    def successors(self, source: str, relation: str) -> set[str]:
        return {
            t
            for t in self.graph.edges(source, relation)
            if (source in self.famous and t in self.famous) or (source, relation, t) in self.edges
        }

    def attribute(self, entity: str, key: str) -> str | None:
        if entity in self.famous or (entity, key) in self.attributes:
            return self.graph[entity].infobox.get(key)
        return None

    def learn_page(self, page_id: str, incoming: dict[str, list[tuple[str, str]]]) -> KnownFacts:
        """These facts plus everything one page states (its links both ways, its infobox)."""
        page = self.graph[page_id]
        edges = set(self.edges)
        edges |= {(page_id, link.relation, t) for link in page.links if (t := self.graph.resolve(link.target))}
        edges |= {(source, relation, page_id) for relation, source in incoming.get(page_id, [])}
        attributes = self.attributes | {(page_id, key) for key in page.infobox}
        return KnownFacts(self.graph, self.famous, edges, attributes)


def famous_entities(graph: Graph, fame_in_degree: int) -> frozenset[str]:
    return frozenset(p.id for p in graph.entities() if p.in_degree >= fame_in_degree)


def incoming_links(graph: Graph) -> dict[str, list[tuple[str, str]]]:
    incoming: dict[str, list[tuple[str, str]]] = {}
    for page in graph.entities():
        for link in page.links:
            target = graph.resolve(link.target)
            if target is not None:
                incoming.setdefault(target, []).append((link.relation, page.id))
    return incoming


def exact_answer(
    facts: KnownFacts, item: QAItem, image_entity: str | None, names: dict[str, set[str]] | None = None
) -> str | None:
    """The answer when the known facts pin down one entity with a known attribute, else None."""
    resolver = Resolver(facts, image_entity=image_entity, names=names)
    targets = resolver.resolve(item.question, len(item.question.mentions) - 1)
    if len(targets) != 1:
        return None
    value = facts.attribute(next(iter(targets)), item.question.attribute)
    return None if value is None else obfuscate(value, item.question.obfuscation)


@dataclass
class ClosedBookSolver:
    """No tools: the question text and famous facts only (the image is not understood)."""

    graph: Graph
    fame_in_degree: int
    name: str = "exact_closed_book"

    def solve(self, item: QAItem) -> SolverAnswer:
        facts = KnownFacts(self.graph, famous_entities(self.graph, self.fame_in_degree))
        return SolverAnswer(exact_answer(facts, item, image_entity=None), 0)


def _useful_pages(graph: Graph, item: QAItem) -> list[str]:
    """Pages whose facts could complete the chain. A fact is stated only by the pages of its own
    entities, so for a chain of path-relative descriptors only the path nodes' pages matter;
    nested descriptors reach beyond the path, and then every page is tried."""
    nested = any(
        isinstance(c, Rel) and not isinstance(c.target, int) for m in item.question.mentions for c in m.constraints
    )
    return [p.id for p in graph.entities()] if nested else list(dict.fromkeys(item.path))


@dataclass
class ImageSearchSolver:
    """One ImageSearch call: it recognises the anchor and reads the matched image's caption facts;
    with ``text_search`` it also reads the single most useful page of the corpus."""

    graph: Graph
    images_by_page: dict[str, list[ImageRecord]]
    fame_in_degree: int
    text_search: bool = False
    name: str = "exact_image_search"

    def __post_init__(self) -> None:
        self._famous = famous_entities(self.graph, self.fame_in_degree)
        self._incoming = incoming_links(self.graph)
        self._names = name_index(self.graph)
        if self.text_search:
            self.name = "exact_image_search_plus_text_search"

    def solve(self, item: QAItem) -> SolverAnswer:
        anchor = item.path[0]
        edges = {
            (anchor, relation, resolved)
            for record in self.images_by_page.get(anchor, [])
            for relation, target in record.facts
            if (resolved := self.graph.resolve(target))
        }
        facts = KnownFacts(self.graph, self._famous, edges)
        answer = exact_answer(facts, item, image_entity=anchor, names=self._names)
        if answer is not None or not self.text_search:
            return SolverAnswer(answer, 1)
        for page in _useful_pages(self.graph, item):  # the best single TextSearch result, exhaustively
            answer = exact_answer(facts.learn_page(page, self._incoming), item, anchor, self._names)
            if answer is not None:
                return SolverAnswer(answer, 2)
        return SolverAnswer(None, 2)


@dataclass
class CachedSolver:
    """Memoises a solver per (item id, question text) on disk and stops after ``budget`` calls."""

    solver: Solver
    cache_path: Path | None = None
    budget: int | None = None
    calls: int = 0
    _cache: dict[str, SolverAnswer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = self.solver.name
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"solver budget must be >= 0, got {self.budget}")
        if self.cache_path is not None and Path(self.cache_path).exists():
            for _, row in iter_jsonl(self.cache_path):
                self._cache[row["key"]] = SolverAnswer(row["answer"], row["tool_calls"])

    def solve(self, item: QAItem) -> SolverAnswer:
        key = json.dumps([self.solver.name, item.id, item.text])
        if key in self._cache:
            return self._cache[key]
        if self.budget is not None and self.calls >= self.budget:
            raise BudgetExhausted(f"solver {self.solver.name!r} used its budget of {self.budget} calls")
        self.calls += 1
        answer = self.solver.solve(item)
        self._cache[key] = answer
        if self.cache_path is not None:
            Path(self.cache_path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"key": key, "answer": answer.answer, "tool_calls": answer.tool_calls}) + "\n")
        return answer


def solved(answer: SolverAnswer, item: QAItem) -> bool:
    accepted = {normalize_answer(a) for a in [item.answer, *item.aliases]}
    return answer.answer is not None and normalize_answer(answer.answer) in accepted


@dataclass
class SolverFilter:
    """Stage: drop the item (with ``reason``) when ``solver`` answers it correctly."""

    solver: Solver
    reason: str

    def __call__(self, item: QAItem) -> QAItem | Drop:
        return Drop(self.reason) if solved(self.solver.solve(item), item) else item


def images_by_page(images) -> dict[str, list[ImageRecord]]:
    grouped: dict[str, list[ImageRecord]] = {}
    for record in images:
        grouped.setdefault(record.page_id, []).append(record)
    return grouped
