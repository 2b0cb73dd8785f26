"""Constrained random walks over the hyperlink graph (Sec. 3.1, App. D.1).

Each outgoing link is first dereferenced through redirects; the target is then skipped when it is
missing, in a non-article namespace, a disambiguation page, a "List of/Outline of/Index of/
Timeline of" page, a hub (in-degree above tau), not an entity, or already on the path (cycle).
The walk picks uniformly among what is left. A walk fails when it reaches a dead end or its last
node has no short answer; :func:`sample_with_retries` retries a seed (also when a downstream
stage, e.g. rewriting, rejects the path) and drops it after ``max_retries`` attempts.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from osvl.synth.question import leaked_forms
from osvl.world.graph import DOMAINS, Graph, Page, namespace_of

LIST_PREFIXES = ("List of", "Outline of", "Index of", "Timeline of")
T = TypeVar("T")


@dataclass(frozen=True)
class SamplingConfig:
    hops: tuple[int, ...] = (2, 3, 4)
    hop_probs: tuple[float, ...] = (0.4, 0.4, 0.2)
    hub_threshold: int = 10_000  # tau: in-degree above this is a hub
    min_seed_in_degree: int = 50
    min_image_side: int = 512
    max_retries: int = 10
    max_answer_tokens: int = 6

    def __post_init__(self) -> None:
        if len(self.hops) != len(self.hop_probs) or not self.hops:
            raise ValueError("SamplingConfig.hops and hop_probs must be non-empty and the same length")
        if any(h < 1 for h in self.hops) or any(p < 0 for p in self.hop_probs):
            raise ValueError("SamplingConfig.hops must be >= 1 and hop_probs >= 0")
        if abs(sum(self.hop_probs) - 1.0) > 1e-9:
            raise ValueError(f"SamplingConfig.hop_probs must sum to 1, got {sum(self.hop_probs)}")
        if self.min_seed_in_degree > self.hub_threshold:
            raise ValueError("SamplingConfig.min_seed_in_degree must not exceed hub_threshold")
        if self.max_retries < 1 or self.max_answer_tokens < 1:
            raise ValueError("SamplingConfig.max_retries and max_answer_tokens must be >= 1")


@dataclass(frozen=True)
class SampledPath:
    nodes: tuple[str, ...]  # v0 (anchor), bridges, answer node
    relations: tuple[str, ...]  # relations[i] labels the edge nodes[i] -> nodes[i + 1]
    attribute: str
    answer: str

    @property
    def hops(self) -> int:
        return len(self.relations)


@dataclass
class WalkFailure:
    reason: str  # "dead_end" | "no_short_answer"
    skipped: Counter = field(default_factory=Counter)


def skip_reason(graph: Graph, page_id: str, config: SamplingConfig) -> str | None:
    """Why a (dereferenced) node may not be on a walk, or None when it may."""
    if page_id not in graph:
        return "missing"
    page = graph[page_id]
    if page.namespace:
        return "namespace"
    if page.disambiguation or "(disambiguation)" in page.title:
        return "disambiguation"
    if page.title.startswith(LIST_PREFIXES):
        return "list"
    if page.in_degree > config.hub_threshold:
        return "hub"
    if page.domain is None:
        return "not_entity"
    return None


def next_steps(
    graph: Graph, node: str, visited: set[str], config: SamplingConfig
) -> tuple[list[tuple[str, str]], Counter]:
    """Eligible ``(target, relation)`` steps out of ``node`` and a count of skipped links by reason."""
    steps, skipped, seen = [], Counter(), set()
    for link in graph[node].links:
        target = graph.resolve(link.target)
        if target is None:  # dangling: File:/Category: pages are often absent from extracts
            reason = "namespace" if namespace_of(link.target.replace("_", " ")) else "missing"
        else:
            reason = skip_reason(graph, target, config)
        if reason is None and target in visited:
            reason = "cycle"
        if reason is not None:
            skipped[reason] += 1
        elif (target, link.relation) not in seen:
            seen.add((target, link.relation))
            steps.append((target, link.relation))
    return steps, skipped


def short_answer(
    page: Page, banned_forms: list[str], config: SamplingConfig, rng: random.Random
) -> tuple[str, str] | None:
    """A random infobox attribute with a value of at most ``max_answer_tokens`` tokens that names
    no node of the path."""
    options = [
        (k, v)
        for k, v in page.infobox.items()
        if 0 < len(v.split()) <= config.max_answer_tokens and not leaked_forms(v, banned_forms)
    ]
    return rng.choice(options) if options else None


def walk(graph: Graph, seed: str, hops: int, rng: random.Random, config: SamplingConfig) -> SampledPath | WalkFailure:
    nodes, relations, skipped = [seed], [], Counter()
    for _ in range(hops):
        steps, why = next_steps(graph, nodes[-1], set(nodes), config)
        skipped += why
        if not steps:
            return WalkFailure("dead_end", skipped)
        target, relation = rng.choice(steps)
        nodes.append(target)
        relations.append(relation)
    forms = [f for n in nodes for f in graph.surface_forms(n)]
    answer = short_answer(graph[nodes[-1]], forms, config, rng)
    if answer is None:
        return WalkFailure("no_short_answer", skipped)
    return SampledPath(tuple(nodes), tuple(relations), answer[0], answer[1])


def sample_hops(rng: random.Random, config: SamplingConfig) -> int:
    return rng.choices(config.hops, weights=config.hop_probs)[0]


def seed_reason(graph: Graph, page: Page, config: SamplingConfig) -> str | None:
    """Why a page cannot seed a walk: it needs an infobox, a big image and a mid in-degree."""
    base = skip_reason(graph, page.id, config)
    if base is not None:
        return base
    if not page.infobox:
        return "no_infobox"
    if not any(min(i.width, i.height) >= config.min_image_side for i in page.images):
        return "no_large_image"
    if page.in_degree < config.min_seed_in_degree:
        return "low_in_degree"
    return None


def stratified_seeds(graph: Graph, config: SamplingConfig, per_domain: int, rng: random.Random) -> list[str]:
    """Up to ``per_domain`` eligible seeds from each of the five domains, domains interleaved."""
    by_domain: dict[str, list[str]] = {d: [] for d in DOMAINS}
    for page in sorted(graph.entities(), key=lambda p: p.id):
        if seed_reason(graph, page, config) is None:
            by_domain[page.domain].append(page.id)  # type: ignore[index]
    for ids in by_domain.values():
        rng.shuffle(ids)
    picked = [ids[:per_domain] for ids in by_domain.values()]
    return [seed for row in zip(*[p + [None] * (per_domain - len(p)) for p in picked]) for seed in row if seed]


@dataclass(frozen=True)
class Rejection:
    """A downstream stage's refusal of a sampled path; the seed is retried."""

    reason: str


@dataclass
class SeedOutcome:
    seed: str
    result: object | None  # what ``accept`` returned for the accepted attempt, None when dropped
    attempts: int
    failures: Counter  # failure reason -> attempts


def sample_with_retries(
    graph: Graph, seed: str, rng: random.Random, config: SamplingConfig, accept: Callable[[SampledPath], T | Rejection]
) -> SeedOutcome:
    """Walk from ``seed`` until ``accept`` returns a record rather than a :class:`Rejection`."""
    failures: Counter = Counter()
    for attempt in range(1, config.max_retries + 1):
        path = walk(graph, seed, sample_hops(rng, config), rng, config)
        if isinstance(path, WalkFailure):
            failures[path.reason] += 1
            continue
        outcome = accept(path)
        if isinstance(outcome, Rejection):
            failures[outcome.reason] += 1
            continue
        return SeedOutcome(seed, outcome, attempt, failures)
    return SeedOutcome(seed, None, config.max_retries, failures)
