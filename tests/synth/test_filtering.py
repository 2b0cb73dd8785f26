"""Exact solvers, their knowledge model, caching and budgets, and the filter stages."""

from __future__ import annotations

from pathlib import Path

import pytest

from osvl.synth.filtering import (
    BudgetExhausted,
    CachedSolver,
    ClosedBookSolver,
    ImageSearchSolver,
    KnownFacts,
    SolverAnswer,
    SolverFilter,
    famous_entities,
    incoming_links,
    solved,
)
from osvl.synth.question import Mention, Rel
from osvl.synth.records import Drop, QAItem
from osvl.synth.rewrite import canonical_question
from osvl.world.build import ImageRecord

from .graphs import australia_zoo_graph
from .test_rewrite import PATH, TOOK_OVER_1991


def _item(graph) -> QAItem:
    question = canonical_question(graph, PATH).with_mention(0, Mention(noun="zoo", visual=True))
    question = question.with_mention(1, TOOK_OVER_1991).with_mention(
        2, Mention(noun="person", constraints=(Rel("spouse", 1),))
    )
    return QAItem("AZ", list(PATH.nodes), list(PATH.relations), PATH.attribute, PATH.answer, question)


def _caption(facts) -> dict[str, list[ImageRecord]]:
    return {"Australia_Zoo": [ImageRecord(Path("az.png"), "Australia Zoo", "", "Australia_Zoo", 800, 600, facts)]}


def test_known_facts_are_famous_pairs_plus_learned_ones():
    graph = australia_zoo_graph()
    facts = KnownFacts(graph, frozenset({"Australia_Zoo", "Bob_Irwin"}))
    assert facts.successors("Australia_Zoo", "manager") == {"Bob_Irwin"}
    assert facts.attribute("Steve_Irwin", "death year") is None
    learned = facts.learn_page("Steve_Irwin", incoming_links(graph))
    assert learned.successors("Australia_Zoo", "manager") == {"Bob_Irwin", "Steve_Irwin"}
    assert learned.successors("Steve_Irwin", "spouse") == {"Terri_Irwin"}
    assert learned.attribute("Steve_Irwin", "death year") == "2006"
    assert learned.attribute("Terri_Irwin", "citizenship date") is None


def test_closed_book_solver_needs_the_facts_to_be_famous():
    graph = australia_zoo_graph()
    item = _item(graph)
    assert ClosedBookSolver(graph, fame_in_degree=1000).solve(item) == SolverAnswer(None, 0)
    for page in graph.entities():
        page.in_degree = max(page.in_degree, 100)
    # everything famous, and only one zoo in the world: the image is not even needed
    assert ClosedBookSolver(graph, fame_in_degree=100).solve(item).answer == PATH.answer
    assert famous_entities(graph, 100) >= {"Steve_Irwin", "Terri_Irwin"}


def test_image_search_solver_uses_caption_facts_and_one_page():
    graph = australia_zoo_graph()
    item = _item(graph)
    assert ImageSearchSolver(graph, _caption([]), 10**6).solve(item) == SolverAnswer(None, 1)
    # one TextSearch is not enough for two hops without a caption fact ...
    assert ImageSearchSolver(graph, _caption([]), 10**6, text_search=True).solve(item) == SolverAnswer(None, 2)
    # ... but a caption naming the bridge leaks one hop, and Terri's page then finishes the chain
    leaky = _caption([["manager", "The_Crocodile_Hunter"]])
    assert ImageSearchSolver(graph, leaky, 10**6).solve(item).answer is None  # management start unknown
    graph["Steve_Irwin"].in_degree = 10**6
    answer = ImageSearchSolver(graph, leaky, 10**6, text_search=True).solve(item)
    assert answer == SolverAnswer(PATH.answer, 2)


def test_cache_and_budget(tmp_path):
    graph = australia_zoo_graph()
    item = _item(graph)

    class Counting:
        name = "counting"
        calls = 0

        def solve(self, item):
            Counting.calls += 1
            return SolverAnswer("42", 0)

    cache = tmp_path / "cache.jsonl"
    solver = CachedSolver(Counting(), cache, budget=1)
    assert solver.solve(item).answer == "42" and solver.solve(item).answer == "42"
    assert Counting.calls == 1 and solver.calls == 1
    other = QAItem(**{**item.__dict__, "id": "other"})
    with pytest.raises(BudgetExhausted, match="budget of 1"):
        solver.solve(other)
    reloaded = CachedSolver(Counting(), cache, budget=0)
    assert reloaded.solve(item).answer == "42" and Counting.calls == 1
    with pytest.raises(ValueError, match="budget"):
        CachedSolver(Counting(), budget=-1)


def test_solver_filter_drops_only_correct_answers():
    graph = australia_zoo_graph()
    item = _item(graph)

    class Fixed:
        name = "fixed"

        def __init__(self, answer):
            self.answer = answer

        def solve(self, item):
            return SolverAnswer(self.answer, 1)

    assert SolverFilter(Fixed("17 November 2009."), "easy")(item) == Drop("easy")
    assert SolverFilter(Fixed("1 May 2000"), "easy")(item) is item
    assert SolverFilter(Fixed(None), "easy")(item) is item
    assert solved(SolverAnswer("THE 17 november 2009"), item)
