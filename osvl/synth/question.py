"""A multi-hop question as a chain of entity mentions, its rendering, and its exact resolution.

Path ``v0 -rho1-> v1 ... -rhoh-> vh``; the question asks an attribute of ``vh``. Mention ``i``
refers to ``vi``: by name, by a descriptor (relation to another mention plus attribute
qualifiers), by free text from an LLM (``{prev}`` stands for mention ``i-1``), or visually ("the
zoo in the image"). Rendering is for models; resolution over a :class:`Facts` view is the exact
uniqueness evaluator of a closed world.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Protocol

from osvl.rl.offline_judges import normalize_answer
from osvl.world.graph import Graph

# ---------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Rel:
    """Holds for x when some entity t the ``target`` refers to has an edge ``t --relation--> x``."""

    relation: str
    target: int | Mention  # a path index (its current mention) or a nested mention


@dataclass(frozen=True)
class Attr:
    key: str
    value: str


@dataclass(frozen=True)
class Mention:
    name: str | None = None
    noun: str | None = None
    constraints: tuple[Rel | Attr, ...] = ()
    visual: bool = False
    text: str | None = None  # free-text descriptor; "{prev}" is replaced by the previous mention


@dataclass(frozen=True)
class Question:
    mentions: tuple[Mention, ...]  # one per path node, v0 first
    attribute: str
    obfuscation: str | None = None  # "year" | "nearest_ten"

    def with_mention(self, index: int, mention: Mention) -> Question:
        mentions = list(self.mentions)
        mentions[index] = mention
        return replace(self, mentions=tuple(mentions))


def mention_to_dict(mention: Mention) -> dict[str, Any]:
    return {
        "name": mention.name,
        "noun": mention.noun,
        "visual": mention.visual,
        "text": mention.text,
        "constraints": [
            {"attr": c.key, "value": c.value}
            if isinstance(c, Attr)
            else {"rel": c.relation, "target": c.target if isinstance(c.target, int) else mention_to_dict(c.target)}
            for c in mention.constraints
        ],
    }


def mention_from_dict(data: dict[str, Any]) -> Mention:
    constraints: list[Rel | Attr] = []
    for c in data.get("constraints", []):
        if "attr" in c:
            constraints.append(Attr(c["attr"], c["value"]))
        else:
            target = c["target"]
            constraints.append(Rel(c["rel"], target if isinstance(target, int) else mention_from_dict(target)))
    return Mention(
        name=data.get("name"),
        noun=data.get("noun"),
        constraints=tuple(constraints),
        visual=bool(data.get("visual", False)),
        text=data.get("text"),
    )


def question_to_dict(question: Question) -> dict[str, Any]:
    return {
        "mentions": [mention_to_dict(m) for m in question.mentions],
        "attribute": question.attribute,
        "obfuscation": question.obfuscation,
    }


def question_from_dict(data: dict[str, Any]) -> Question:
    return Question(
        mentions=tuple(mention_from_dict(m) for m in data["mentions"]),
        attribute=data["attribute"],
        obfuscation=data.get("obfuscation"),
    )


# ---------------------------------------------------------------------------------------------
# Rendering


def render_mention(question: Question, index: int | Mention) -> str:
    mention = question.mentions[index] if isinstance(index, int) else index
    if mention.visual:
        return f"the {mention.noun or 'entity'} shown in the image"
    if mention.text is not None:
        if not isinstance(index, int) or index == 0:
            return mention.text
        return mention.text.replace("{prev}", render_mention(question, index - 1))
    rels = [c for c in mention.constraints if isinstance(c, Rel)]
    attrs = [c for c in mention.constraints if isinstance(c, Attr)]
    if mention.name is not None:
        if not rels:
            return mention.name
        apposition = "; ".join(f"the {r.relation} of {render_mention(question, r.target)}" for r in rels)
        return f"{mention.name} ({apposition})"
    qualifier = f" ({'; '.join(f'{a.key}: {a.value}' for a in attrs)})" if attrs else ""
    if not rels:
        return f"the {mention.noun or 'entity'}{qualifier}"
    # qualifiers sit right after the head they qualify, so nesting cannot misattach them
    return " and ".join(
        f"the {r.relation}{qualifier if i == 0 else ''} of {render_mention(question, r.target)}"
        for i, r in enumerate(rels)
    )


def render_question(question: Question) -> str:
    subject = render_mention(question, len(question.mentions) - 1)
    if question.obfuscation == "year":
        return f"In what year is the {question.attribute} of {subject}?"
    if question.obfuscation == "nearest_ten":
        return f"What is the {question.attribute} of {subject}, rounded to the nearest ten?"
    return f"What is the {question.attribute} of {subject}?"


def obfuscate(value: str, obfuscation: str | None) -> str | None:
    """The answer under an obfuscation, or None when it does not apply to this value."""
    if obfuscation is None:
        return value
    if obfuscation == "year":
        year = re.fullmatch(r"\d{1,2} [A-Z][a-z]+ (\d{3,4})", value.strip())
        return year.group(1) if year else None
    if obfuscation == "nearest_ten":
        return str((int(value) + 5) // 10 * 10) if value.strip().isdigit() and int(value) >= 20 else None
    raise ValueError(f"unknown obfuscation {obfuscation!r}; expected 'year' or 'nearest_ten'")


def leaked_forms(text: str, forms: list[str]) -> list[str]:
    """Surface forms (names, aliases) that appear in ``text`` as whole words, ignoring case."""
    haystack = f" {normalize_answer(text)} "
    return sorted({f for f in forms if normalize_answer(f) and f" {normalize_answer(f)} " in haystack})


# ---------------------------------------------------------------------------------------------
# Exact resolution


class Facts(Protocol):
    """What a resolver may use: the closed world, or the part a solver knows."""

    graph: Graph

    def successors(self, source: str, relation: str) -> set[str]: ...

    def attribute(self, entity: str, key: str) -> str | None: ...


class GraphFacts:
    """Every fact of the graph: the exact evaluator of a closed world."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def successors(self, source: str, relation: str) -> set[str]:
        return set(self.graph.edges(source, relation))

    def attribute(self, entity: str, key: str) -> str | None:
        return self.graph[entity].infobox.get(key)


def name_index(graph: Graph) -> dict[str, set[str]]:
    """Normalized surface form -> entities that carry it (shared names map to several)."""
    names: dict[str, set[str]] = {}
    for page in graph.entities():
        for form in graph.surface_forms(page.id):
            names.setdefault(normalize_answer(form), set()).add(page.id)
    return names


@dataclass
class Resolver:
    """Sets of entities a mention can denote, given facts and what the image shows (if anything)."""

    facts: Facts
    image_entity: str | None = None  # the entity the question image identifies; None = no image
    names: dict[str, set[str]] | None = None  # a prebuilt :func:`name_index` (built when None)

    def __post_init__(self) -> None:
        if self.names is None:
            self.names = name_index(self.facts.graph)

    def resolve(self, question: Question, index: int | Mention) -> set[str]:
        mention = question.mentions[index] if isinstance(index, int) else index
        graph = self.facts.graph
        if mention.text is not None:
            raise ValueError("a free-text descriptor cannot be resolved exactly; use an LLM evaluator")
        if mention.visual and self.image_entity is not None:
            return {self.image_entity}
        if mention.name is not None:
            candidates = set(self.names.get(normalize_answer(mention.name), ()))  # type: ignore[union-attr]
        else:
            # the noun constrains only where the rendering shows it (no relation phrase)
            shown = mention.noun is not None and not any(isinstance(c, Rel) for c in mention.constraints)
            candidates = {p.id for p in graph.entities() if not shown or p.kind == mention.noun}
        for constraint in mention.constraints:
            if isinstance(constraint, Attr):
                wanted = normalize_answer(constraint.value)
                candidates = {
                    c for c in candidates if normalize_answer(self.facts.attribute(c, constraint.key) or "") == wanted
                }
            else:
                reachable: set[str] = set()
                for source in self.resolve(question, constraint.target):
                    reachable |= self.facts.successors(source, constraint.relation)
                candidates &= reachable
            if not candidates:
                break
        return candidates

    def answers(self, question: Question) -> set[str]:
        """Every answer the question admits (an entity lacking the attribute admits none)."""
        found = set()
        for entity in self.resolve(question, len(question.mentions) - 1):
            value = self.facts.attribute(entity, question.attribute)
            answer = None if value is None else obfuscate(value, question.obfuscation)
            if answer is not None:
                found.add(answer)
        return found
