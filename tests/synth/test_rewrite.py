"""Canonical question and fuzzy rewriting on the paper's running example (App. D.2, Table 6)."""

from __future__ import annotations

import random

import pytest

from osvl.synth.question import (
    Attr,
    GraphFacts,
    Mention,
    Rel,
    Resolver,
    leaked_forms,
    obfuscate,
    question_from_dict,
    question_to_dict,
    render_question,
)
from osvl.synth.rewrite import (
    ExactGraphEvaluator,
    GraphDescriptorProposer,
    canonical_question,
    path_forms,
    rewrite,
)
from osvl.synth.sampling import SampledPath

from .graphs import australia_zoo_graph

PATH = SampledPath(
    ("Australia_Zoo", "Steve_Irwin", "Terri_Irwin"), ("manager", "spouse"), "citizenship date", "17 November 2009"
)
SON_OF_FOUNDERS = Mention(noun="person", constraints=(Rel("child", Mention(constraints=(Rel("founder", 0),))),))
TOOK_OVER_1991 = Mention(noun="person", constraints=(Rel("manager", 0), Attr("management start", "1991")))
DOCUMENTARY_HOST = Mention(
    noun="person", constraints=(Attr("occupation", "wildlife documentary host"), Attr("death year", "2006"))
)


class Table6Proposer:
    """The descriptor candidates of the paper's Table 6, in its order."""

    def propose(self, question, path, index):
        if index == 2:
            return [Mention(noun="person", constraints=(Rel("spouse", 1),))]
        return [SON_OF_FOUNDERS, TOOK_OVER_1991, DOCUMENTARY_HOST]


def test_canonical_question_names_every_node():
    text = render_question(canonical_question(australia_zoo_graph(), PATH))
    assert text == (
        "What is the citizenship date of Terri Irwin (the spouse of Steve Irwin (the manager of Australia Zoo))?"
    )


def test_rewriting_rejects_the_non_unique_descriptor_and_accepts_a_unique_one():
    graph = australia_zoo_graph()
    result = rewrite(graph, PATH, Table6Proposer(), ExactGraphEvaluator(graph), random.Random(0))
    assert result.reason == "ok"
    steve = [entry for entry in result.log if entry.node == "Steve_Irwin"]
    assert [e.verdict for e in steve] == ["not_unique", "ok"]  # Bob and Lyn had three children
    question = result.question
    assert question.mentions[1] == TOOK_OVER_1991
    text = render_question(question)
    assert text == (
        "What is the citizenship date of the spouse of the manager (management start: 1991) of Australia Zoo?"
    )
    assert leaked_forms(text, path_forms(graph, PATH, range(1, 3))) == []
    assert "Crocodile Hunter" not in text and "Irwin" not in text
    assert Resolver(GraphFacts(graph)).answers(question) == {"17 November 2009"}


def test_evaluator_verdicts_on_table6_candidates():
    graph = australia_zoo_graph()
    evaluator = ExactGraphEvaluator(graph)
    base = canonical_question(graph, PATH).with_mention(2, Mention(noun="person", constraints=(Rel("spouse", 1),)))
    son = evaluator.evaluate(base.with_mention(1, SON_OF_FOUNDERS), PATH, 1, PATH.answer)
    assert not son.accepted and son.reason == "not_unique"
    assert son.compatible == ("Joy_Irwin", "Mandy_Irwin", "Steve_Irwin")
    host = evaluator.evaluate(base.with_mention(1, DOCUMENTARY_HOST), PATH, 1, PATH.answer)
    assert host.accepted  # unique, though it no longer passes through the anchor
    wrong = evaluator.evaluate(base.with_mention(1, TOOK_OVER_1991), PATH, 1, "1 January 2000")
    assert not wrong.accepted and wrong.reason == "answer_changed"


def test_graph_proposer_rejects_the_bare_relation_and_alias_leaks():
    graph = australia_zoo_graph()
    result = rewrite(
        graph, PATH, GraphDescriptorProposer(graph, random.Random(3)), ExactGraphEvaluator(graph), random.Random(0)
    )
    assert result.reason == "ok"
    steve = [e for e in result.log if e.node == "Steve_Irwin"]
    assert steve[0].verdict == "not_unique"  # "the manager of Australia Zoo": Bob and Steve
    assert steve[-1].verdict == "ok"
    text = render_question(result.question)
    assert leaked_forms(text, path_forms(graph, PATH, range(1, 3))) == []
    assert Resolver(GraphFacts(graph)).answers(result.question) == {PATH.answer}


def test_a_descriptor_that_leaks_an_alias_is_rejected():
    graph = australia_zoo_graph()
    nickname = Mention(noun="person", constraints=(Rel("manager", 0), Attr("nickname", "Crocodile Hunter")))

    class Leaky:
        def propose(self, question, path, index):
            return Table6Proposer().propose(question, path, 2) if index == 2 else [nickname, TOOK_OVER_1991]

    result = rewrite(graph, PATH, Leaky(), ExactGraphEvaluator(graph), random.Random(0))
    assert [e.verdict for e in result.log if e.node == "Steve_Irwin"] == ["leak", "ok"]
    assert GraphDescriptorProposer(graph, random.Random(0)).propose(None, PATH, 1).count(nickname) == 1


def test_rewriting_fails_when_no_descriptor_is_unique():
    graph = australia_zoo_graph()

    class OnlyAmbiguous:
        def propose(self, question, path, index):
            return [Mention(noun="person", constraints=(Rel("spouse", 1),))] if index == 2 else [SON_OF_FOUNDERS]

    result = rewrite(graph, PATH, OnlyAmbiguous(), ExactGraphEvaluator(graph), random.Random(0))
    assert result.question is None and result.reason == "no_unique_descriptor:1"


def test_answer_obfuscation_keeps_invariance():
    graph = australia_zoo_graph()
    result = rewrite(graph, PATH, Table6Proposer(), ExactGraphEvaluator(graph), random.Random(0), obfuscate_prob=1.0)
    assert result.question.obfuscation == "year" and result.answer == "2009"
    assert render_question(result.question).startswith("In what year is the citizenship date of the spouse")
    assert Resolver(GraphFacts(graph)).answers(result.question) == {"2009"}


def test_obfuscate_and_leaks():
    assert obfuscate("17 November 2009", "year") == "2009" and obfuscate("blue", "year") is None
    assert obfuscate("137", "nearest_ten") == "140" and obfuscate("7", "nearest_ten") is None
    with pytest.raises(ValueError, match="unknown obfuscation"):
        obfuscate("1", "rot13")
    assert leaked_forms("Who married THE crocodile-hunter?", ["The Crocodile Hunter", "Steve"]) == [
        "The Crocodile Hunter"
    ]
    assert leaked_forms("Stevenson", ["Steve"]) == []


def test_question_round_trips_through_dicts():
    question = canonical_question(australia_zoo_graph(), PATH).with_mention(1, SON_OF_FOUNDERS)
    assert question_from_dict(question_to_dict(question)) == question


def test_free_text_mentions_need_an_llm_evaluator():
    graph = australia_zoo_graph()
    question = canonical_question(graph, PATH).with_mention(1, Mention(text="the man who ran {prev}"))
    assert "the man who ran Australia Zoo" in render_question(question)
    with pytest.raises(ValueError, match="LLM evaluator"):
        Resolver(GraphFacts(graph)).resolve(question, 2)
