"""The scripted expert and its offline tools on the mini-world."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.trajectory import ToolCall, ToolStatus
from osvl.synth.expert import (
    ExpertConfig,
    ScriptedExpert,
    SynthesisReport,
    WorldTools,
    answer_step,
    read_passages,
    synthesize,
    top_match_page,
)
from osvl.synth.pipeline import question_image
from osvl.synth.records import read_items


@pytest.fixture(scope="module")
def tools(world):
    return WorldTools(world)


def test_text_search_finds_the_page_and_the_relevant_sentences(world, tools):
    page = next(p for p in world.graph.entities() if p.domain == "Building/Place")
    text = tools.text_search(f"{page.title} architect")
    first = read_passages(text)[0]
    architect = world.graph[world.graph.edges(page.id, "architect")[0]].title
    assert first[:2] == (page.id, page.title) and f"The architect of {page.title} is {architect}." in first[2]
    assert text.startswith(f"[Passage 1] {page.title}\nURL: world://{page.id}\nSummary: ")
    assert tools.text_search("zzzz qqqq") == "no results"


def test_text_search_reads_as_the_offline_tool_does(world, tools, tmp_path):
    """The expert's observations are the policy's: the same query shows the same passage through the
    offline tool the rollouts call (SFT trained on one summary and evaluated on another before)."""
    from osvl.tools.config import TextSearchConfig
    from osvl.tools.text_search import offline_search, render_passages

    config = TextSearchConfig(corpus_path=str(world.root / "corpus.jsonl"), index_path=str(tmp_path / "i.sqlite"))
    pages = [p for p in world.graph.entities() if p.infobox or p.links][:40]
    queries = [f"{p.title} {next(iter(p.infobox), 'country')}" for p in pages] + [
        f"{p.title} {p.links[0].relation}" for p in pages if p.links
    ]
    for query in queries:
        assert tools.text_search(query, 1) == render_passages(offline_search(query, 1, config)), query


def test_text_search_ranks_a_query_once(world, monkeypatch):
    tools = WorldTools(world)
    calls = []
    rank = tools._rank
    monkeypatch.setattr(tools, "_rank", lambda query, top_k: calls.append((query, top_k)) or rank(query, top_k))
    page = next(p for p in world.graph.entities() if p.domain == "Person")
    first = tools.text_search(f"{page.title} spouse", 1)
    assert tools.text_search(f"{page.title} spouse", 1) == first and calls == [(f"{page.title} spouse", 1)]
    assert tools.text_search(f"{page.title} spouse", 2).startswith(first)  # another top_k is another search
    assert len(calls) == 2


def test_image_search_recognises_clean_and_degraded_images(world, tools):
    record = next(r for r in world.images() if r.width >= 512)
    image = world.load_image(record.page_id)
    found = tools.image_search(image)
    assert found.startswith(f"[Match 1] {record.title} (page: {record.page_id}; near_duplicate, score 1)")
    assert top_match_page(found) == record.page_id
    small = np.ascontiguousarray(image[::4, ::4])
    assert top_match_page(tools.image_search(small)) == record.page_id


def test_tool_errors_are_statuses(tools):
    assert tools(ToolCall("image_search", {"image": 3}), []).status is ToolStatus.TOOL_ERROR
    assert tools(ToolCall("text_search", {}), []).status is ToolStatus.TOOL_ERROR
    unknown = tools(ToolCall("teleport", {"image": 0}), [np.zeros((4, 4, 3), np.uint8)])
    assert unknown.status is ToolStatus.TOOL_ERROR and "unknown tool" in unknown.error


def test_careful_expert_answers_every_item_and_slips_get_rejected(world, tools, curated):
    out, _ = curated
    items = list(read_items(out / "items.jsonl"))[:25]
    careful = ScriptedExpert(world.graph, tools, ExpertConfig(slip_prob=0.0, repeat_prob=0.0))
    report = SynthesisReport()
    for group, item in enumerate(items):
        kept = synthesize(
            item,
            question_image(world, out, item),
            careful,
            1,
            random.Random(group),
            ExactMatchAccuracyJudge(),
            HeuristicQueryJudge(),
            0.97,
            report,
            group,
        )
        assert len(kept) == 1
    assert report.kept == 25 and report.rejected_answer == report.rejected_process == 0
    sloppy = ScriptedExpert(world.graph, tools, ExpertConfig(slip_prob=1.0, repeat_prob=1.0))
    report = SynthesisReport()
    for group, item in enumerate(items):
        synthesize(
            item,
            question_image(world, out, item),
            sloppy,
            1,
            random.Random(group),
            ExactMatchAccuracyJudge(),
            HeuristicQueryJudge(),
            0.97,
            report,
            group,
        )
    assert report.kept == 0 and report.rejected_process > 0 and report.rejected_answer > 0


def test_the_answer_step_restates_the_fact_it_answers_from(world, tools, curated):
    out, _ = curated
    careful = ScriptedExpert(world.graph, tools, ExpertConfig(slip_prob=0.0, repeat_prob=0.0))
    items = list(read_items(out / "items.jsonl"))[:25]
    for group, item in enumerate(items):
        *_, lookup, final = careful.rollout(item, question_image(world, out, item), random.Random(group))
        title = re.fullmatch(rf"Look up the {re.escape(item.attribute)} of (.+)\.", lookup.think).group(1)
        stated = re.match(rf"The {re.escape(item.attribute)} of {re.escape(title)} is ([^.]+)\.", final.think).group(1)
        assert f"Its {item.attribute} is {stated}." in lookup.observation_text
        assert final.response == item.answer and final.text.endswith(f"<response>{item.answer}</response>")
        assert ("So the answer is" in final.think) == (item.answer != stated)
    rounded = answer_step("founded", "Zelfen", "1727", "1730")
    assert rounded.think == "The founded of Zelfen is 1727. So the answer is 1730." and rounded.response == "1730"
    assert answer_step("population", "Zelfen", "72000", "72000").think == "The population of Zelfen is 72000."


def test_expert_config_validation():
    with pytest.raises(ValueError, match="slip_prob"):
        ExpertConfig(slip_prob=2.0)


def test_observation_parsers_read_the_tool_formats():
    text = (
        "[Passage 1] Vorka\nURL: world://Vorka\nSummary: Vorka is a city.\n\n"
        "[Passage 2] Elsewhere\nURL: https://example.org/x\nSummary: A web page."
    )
    assert read_passages(text) == [("Vorka", "Vorka", "Vorka is a city."), (None, "Elsewhere", "A web page.")]
    assert read_passages("no results") == []
    match = "[Match 1] Kelpel Talzel (zookeeper) (page: Kelpel_Talzel_(zookeeper); feature_match, score 31)\nCaption: x"
    assert top_match_page(match) == "Kelpel_Talzel_(zookeeper)"
    assert top_match_page("Error (tool_error): no visual matches") is None


def test_repair_stand_ins_take_the_real_tools_defaults(tools):
    image = np.zeros((10, 12, 3), np.uint8)
    up = tools(ToolCall("super_resolution", {"image": 0}), [image])
    assert up.ok and up.images[0].shape == (20, 24, 3)
    assert tools(ToolCall("super_resolution", {"image": 0, "scale": 4}), [image]).images[0].shape == (40, 48, 3)
    assert tools(ToolCall("sharpen", {"image": 0}), [image]).ok


def test_search_top_k_asks_for_one_passage_and_still_answers(world, tools, curated):
    out, _ = curated
    items = list(read_items(out / "items.jsonl"))[:10]
    narrow = ScriptedExpert(world.graph, tools, ExpertConfig(slip_prob=0.0, repeat_prob=0.0, search_top_k=1))
    report = SynthesisReport()
    for group, item in enumerate(items):
        (kept,) = synthesize(
            item,
            question_image(world, out, item),
            narrow,
            1,
            random.Random(group),
            ExactMatchAccuracyJudge(),
            HeuristicQueryJudge(),
            0.97,
            report,
            group,
        )
        searches = [s for s in kept.steps if s.tool_call and s.tool_call.name == "text_search"]
        assert searches and all(s.tool_call.arguments["top_k"] == 1 for s in searches)
        assert all(s.observation_text.count("[Passage ") == 1 for s in searches)
    with pytest.raises(ValueError, match="search_top_k"):
        ExpertConfig(search_top_k=-1)
