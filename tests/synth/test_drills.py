"""Lookup drills: text-only chains whose every observation states the next entity, RL entities left out."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from osvl.rl.trajectory import read_jsonl
from osvl.synth.__main__ import main
from osvl.synth.drills import lookup_drills
from osvl.synth.pipeline import CurationConfig, is_rl
from osvl.synth.records import read_items


def test_drills_follow_the_graph_and_answer_from_the_last_passage(world):
    drills = lookup_drills(world, 40, seed=3)
    assert len(drills) == len({d.prompt.id for d in drills}) == 40
    graph = world.graph
    titles = {p.title: p.id for p in graph.entities()}
    for drill in drills:
        *searches, final = drill.steps
        assert final.response == drill.prompt.answer and final.tool_call is None
        if drill.prompt.images:  # identified by image_search, then named exactly as the match
            seen, *searches = searches
            assert seen.tool_call.name == "image_search" and "shown in the image" in drill.prompt.question
            match = re.search(r"\[Match 1\] (.+) \(page:", seen.observation_text).group(1)
            assert searches[0].tool_call.arguments["query"].startswith(match + " ")
        assert all(s.tool_call.name == "text_search" and s.tool_call.arguments["top_k"] == 1 for s in searches)
        # every hop's query names the entity the previous passage stated: copying is the skill drilled
        for before, after in itertools.pairwise(searches):
            relation, title = re.fullmatch(r"Find the (.+) of (.+)\.", before.think).groups()
            (stated,) = re.findall(rf"The {re.escape(relation)} of {re.escape(title)} is ([^.]+)\.", before.observation_text)
            assert after.tool_call.arguments["query"].startswith(stated + " ") and stated in titles
        assert f"is {drill.prompt.answer}." in searches[-1].observation_text
    assert {len(d.steps) - 2 - bool(d.prompt.images) for d in drills} == {1, 2}
    assert 0 < sum(bool(d.prompt.images) for d in drills) < len(drills)


def test_excluded_entities_never_appear(world):
    graph = world.graph
    excluded = {p.id for i, p in enumerate(sorted(graph.entities(), key=lambda p: p.id)) if i % 2}
    names = {graph[pid].title for pid in excluded}
    for drill in lookup_drills(world, 30, seed=1, excluded=excluded):
        for step in drill.steps[:-1]:
            query = step.tool_call.arguments.get("query", "")  # image_search steps carry none
            assert not any(query.startswith(name + " ") for name in names)


def test_bad_requests_are_clear_errors(world):
    with pytest.raises(ValueError, match="count >= 0"):
        lookup_drills(world, -1)
    with pytest.raises(ValueError, match="every entity is excluded"):
        lookup_drills(world, 1, excluded={p.id for p in world.graph.entities()})
    with pytest.raises(ValueError, match="visual_fraction"):
        lookup_drills(world, 1, visual_fraction=1.5)
    graph = world.graph
    keep = sorted(p.id for p in graph.entities())[:2]  # two entities cannot make 50 distinct drills
    with pytest.raises(ValueError, match="distinct drills"):
        lookup_drills(world, 50, excluded={p.id for p in graph.entities()} - set(keep))


def test_cli_leaves_out_the_rl_items_entities(world, curated, tmp_path, capsys):
    out, _ = curated
    target = tmp_path / "drills.jsonl"
    assert main(["drills", "--world", str(world.root), "--data", str(out), "--count", "25", "--out", str(target)]) == 0
    report = json.loads(capsys.readouterr().out)
    rl_nodes = {n for item in read_items(out / "items.jsonl") if is_rl(item.id, CurationConfig()) for n in item.path}
    assert report["drills"] == 25 and report["excluded_rl_entities"] == len(rl_nodes) > 0
    rl_titles = {world.graph[n].title for n in rl_nodes}
    drills = list(read_jsonl(target))
    assert len(drills) == 25
    for drill in drills:
        assert not any(step.tool_call and step.tool_call.arguments.get("query", "").startswith(tuple(t + " " for t in rl_titles))
                       for step in drill.steps)
    with pytest.raises(SystemExit):
        main(["drills", "--world", str(world.root), "--data", str(tmp_path), "--count", "1", "--out", str(target)])
