"""LLM descriptor proposer and uniqueness evaluator against a loopback chat server."""

from __future__ import annotations

import json
import random

from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.synth.llm import (
    LLMDescriptorProposer,
    LLMUniquenessEvaluator,
    last_json_object,
)
from osvl.synth.question import Mention, Rel, leaked_forms, render_question
from osvl.synth.rewrite import canonical_question, path_forms, rewrite

from .chat_server import LoopbackChat
from .graphs import australia_zoo_graph
from .test_rewrite import PATH


def _client(server, attempts=2):
    return ChatCompletionsClient(
        ChatJudgeConfig(base_url=server.base_url, model="m", max_attempts=attempts), sleep=lambda s: None
    )


def _world_model(prompt: str) -> tuple[int, str]:
    """A scripted 'LLM' that knows the Irwin family."""
    if prompt.startswith("You rewrite"):
        if "Entity: Terri Irwin" in prompt:
            return 200, json.dumps({"descriptors": ["the wife of {prev}"]})
        return 200, "Sure!\n```json\n" + json.dumps(
            {"descriptors": ["the son of the founders of {prev}", "the man who took over management of {prev} in 1991"]}
        ) + "\n```"
    if '"the son of the founders of Australia Zoo"' in prompt:
        return 200, json.dumps({"compatible": ["Joy Irwin", "Steve Irwin", "Mandy Irwin"], "answer": "?"})
    if '"the wife of' in prompt and "Steve Irwin" in prompt.split("Consider")[0]:
        return 200, json.dumps({"compatible": ["Terri Irwin"], "answer": "17 November 2009"})
    if '"the man who took over management of Australia Zoo in 1991"' in prompt:
        return 200, json.dumps({"compatible": ["Steve Irwin"], "answer": "17 November 2009"})
    return 200, json.dumps({"compatible": [], "answer": ""})


def test_llm_rewriting_end_to_end():
    graph = australia_zoo_graph()
    with LoopbackChat(_world_model) as server, _client(server) as client:
        proposer = LLMDescriptorProposer(client, graph, page_context=lambda pid: graph[pid].title)
        result = rewrite(graph, PATH, proposer, LLMUniquenessEvaluator(client, graph), random.Random(0))
    assert result.reason == "ok"
    assert [e.verdict for e in result.log] == ["ok", "not_unique", "ok"]
    text = render_question(result.question)
    assert text == (
        "What is the citizenship date of the wife of the man who took over management of Australia Zoo in 1991?"
    )
    assert leaked_forms(text, path_forms(graph, PATH, range(1, 3))) == []
    assert "aliases (Terri Irwin)" in server.prompts[0]
    assert "The Crocodile Hunter (person)" in server.prompts[2]  # redirect titles are names to avoid too


def test_evaluator_rejects_wrong_entity_and_changed_answer():
    graph = australia_zoo_graph()
    replies = iter(
        [
            json.dumps({"compatible": ["Bob Irwin"], "answer": "17 November 2009"}),
            json.dumps({"compatible": ["the crocodile hunter"], "answer": "1999"}),
            "no json here",
        ]
    )
    question = canonical_question(graph, PATH).with_mention(1, Mention(text="the manager of {prev}"))
    with LoopbackChat(lambda p: (200, next(replies))) as server, _client(server) as client:
        evaluator = LLMUniquenessEvaluator(client, graph)
        assert evaluator.evaluate(question, PATH, 1, PATH.answer).reason == "not_unique"
        changed = evaluator.evaluate(question, PATH, 1, PATH.answer)
        assert changed.reason == "answer_changed" and changed.compatible == ("the crocodile hunter",)
        assert evaluator.evaluate(question, PATH, 1, PATH.answer).reason == "unparsable_verdict"
    assert '"the manager of Australia Zoo"' in server.prompts[0]


def test_transport_failures_become_rejections_not_exceptions():
    graph = australia_zoo_graph()
    question = canonical_question(graph, PATH).with_mention(2, Mention(noun="person", constraints=(Rel("spouse", 1),)))
    with LoopbackChat(lambda p: (500, "")) as server, _client(server, attempts=2) as client:
        proposer = LLMDescriptorProposer(client, graph, page_context=lambda pid: "")
        assert proposer.propose(question, PATH, 1) == [] and proposer.last_error == "http_500"
        verdict = LLMUniquenessEvaluator(client, graph).evaluate(question, PATH, 2, PATH.answer)
        assert not verdict.accepted and verdict.reason == "http_500"
        result = rewrite(graph, PATH, proposer, LLMUniquenessEvaluator(client, graph), random.Random(0))
    assert result.question is None and result.reason == "no_unique_descriptor:2"
    assert len(server.prompts) == 6  # two attempts for each of three calls


def test_last_json_object():
    assert last_json_object('text {"a": 1} more') == {"a": 1}
    assert last_json_object("[1, 2]") is None and last_json_object("{broken") is None
