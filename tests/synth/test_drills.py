"""Lookup drills: text-only chains whose every observation states the next entity, RL entities left out."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from collections import Counter

import numpy as np
import pytest

from osvl.rl.fatal import is_fatal, trajectory_fatal_step
from osvl.rl.trajectory import ToolResult, ToolStatus, read_jsonl, read_prompts
from osvl.synth.__main__ import main
from osvl.synth.drills import (
    RETRY_THINK,
    guess_rates,
    held_out_prompts,
    hop_quota,
    lookup_drills,
    name_drills,
    split_anchors,
    with_caption_link,
    with_recalled_answer,
    with_tool_faults,
)
from osvl.synth.pipeline import CurationConfig, is_rl
from osvl.synth.records import read_items
from osvl.world.generate import CAPTION_RELATIONS


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
            (stated,) = re.findall(
                rf"The {re.escape(relation)} of {re.escape(title)} is ([^.]+)\.", before.observation_text
            )
            assert after.tool_call.arguments["query"].startswith(stated + " ") and stated in titles
        assert f"is {drill.prompt.answer}." in searches[-1].observation_text
        title = re.fullmatch(r"Look up the .+ of (.+)\.", searches[-1].think).group(1)
        assert final.think.startswith("The ") and final.think.endswith(f" of {title} is {drill.prompt.answer}.")
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


def test_drills_start_only_at_the_given_anchors(world):
    anchors = sorted(p.id for p in world.graph.entities() if p.images)[:12]
    drills = lookup_drills(world, 15, seed=2, anchors=anchors, visual_fraction=0.0)
    assert {d.prompt.id.split("-")[2] for d in drills} <= set(anchors)
    prompts = held_out_prompts(world, anchors, 10, seed=4)
    assert len(prompts) == len({p.id for p in prompts}) == 10
    for prompt in prompts:
        anchor = prompt.id.split("-")[2]
        assert prompt.anchor == anchor and prompt.hops == len(prompt.id.split("-")) - 4 >= 1  # id: anchor, hops, attr
        assert anchor in anchors and len(prompt.images) == 1 and "shown in the image" in prompt.question
        assert np.array_equal(prompt.images[0], world.load_image(anchor)) and prompt.answer


def _asked(prompt, world):
    """(kind of the chain's last entity, asked attribute), read back from the drill's prompt id."""
    parts = prompt.id.split("-")
    node = parts[2]
    for relation in parts[3:-1]:
        node = next(world.graph.resolve(link.target) for link in world.graph[node].links if link.relation == relation)
    return world.graph[node].kind or "", parts[-1]


def test_guess_rates_are_the_share_of_the_most_common_value(world):
    rates = guess_rates(world)
    countries = [p for p in world.graph.entities() if p.kind == "country"]
    areas = [p.infobox["area in km2"] for p in countries]
    assert rates["country", "area in km2"] == max(areas.count(a) for a in areas) / len(areas)
    births = [p.infobox["birth date"] for p in world.graph.entities() if p.kind == "person"]
    assert rates["person", "birth date"] == max(births.count(b) for b in births) / len(births) < 0.1
    assert all(0.0 < rate <= 1.0 for rate in rates.values())


def test_guessable_answers_are_never_asked(world):
    rates = guess_rates(world)
    assert max(rates.values()) > 0.3  # the world has answers a blind guess gets right (3 countries)
    unfiltered = held_out_prompts(world, [p.id for p in world.graph.entities() if p.images], 40, seed=5)
    assert max(rates[_asked(p, world)] for p in unfiltered) > 0.15  # so the filter has something to remove
    filtered = held_out_prompts(
        world, [p.id for p in world.graph.entities() if p.images], 40, seed=5, max_guess_rate=0.15
    )
    assert len(filtered) == 40 and all(rates[_asked(p, world)] <= 0.15 for p in filtered)
    drills = lookup_drills(world, 30, seed=6, max_guess_rate=0.15)
    assert all(rates[_asked(d.prompt, world)] <= 0.15 for d in drills)
    assert [d.prompt.id for d in lookup_drills(world, 30, seed=6, max_guess_rate=1.0)] == [
        d.prompt.id for d in lookup_drills(world, 30, seed=6)
    ]  # the default asks everything, as before


def _texts(drill) -> tuple:
    return drill.prompt.id, tuple((s.text, s.observation_text) for s in drill.steps)


def _top_caption(drill) -> str:
    return re.search(r"^Caption: (.*)$", drill.steps[0].observation_text, re.MULTILINE).group(1)


def test_caption_links_state_a_true_link_drawn_per_drill_and_the_expert_still_searches_the_match(world):
    graph = world.graph
    plain = lookup_drills(world, 60, seed=5, visual_fraction=1.0)
    linked = lookup_drills(world, 60, seed=5, visual_fraction=1.0, caption_link_fraction=1.0)
    unchanged = lookup_drills(world, 60, seed=5, visual_fraction=1.0, caption_link_fraction=0.0)
    assert [_texts(d) for d in unchanged] == [_texts(d) for d in plain]  # 0 draws nothing: the drills as before
    stated = {}
    for drill in linked:
        anchor = graph[re.search(r"\(page: ([^;]+);", drill.steps[0].observation_text).group(1)]
        caption = _top_caption(drill)
        links = [
            (link.relation, graph[graph.resolve(link.target)].title, link.anchor)
            for link in anchor.links
            if graph.resolve(link.target)
        ]
        if ";" in caption:
            head, tail = caption.split("; ")
            relation, named = tail.split(": ")
            assert head == f"{anchor.title}, a {anchor.kind}"
            assert any(r == relation and named in (title, text) for r, title, text in links)  # a true link
            stated.setdefault(anchor.id, set()).add(tail)
        else:  # no link a caption may state: the world's own caption, unchanged
            assert not [r for r, _, _ in links if r in CAPTION_RELATIONS]
        assert drill.steps[1].tool_call.arguments["query"].startswith(anchor.title + " ")
    plain_linked = sum(";" in _top_caption(d) for d in plain)
    assert sum(";" in _top_caption(d) for d in linked) > plain_linked
    assert any(len(tails) > 1 for tails in stated.values())  # the same image, different linked names


def test_with_caption_link_leaves_a_page_without_links_and_the_other_matches_alone(world):
    graph = world.graph
    page = next(p for p in graph.entities() if p.images)
    top = f"[Match 1] {page.title} (page: {page.id}; near_duplicate, score 1)"
    text = f"{top}\nCaption: old\n\n[Match 2] B\nCaption: keep"
    result = ToolResult(ToolStatus.OK, "image_search", text)
    changed = with_caption_link(result, page, world, random.Random(0))
    lines = changed.text.splitlines()
    assert lines[0] == text.splitlines()[0] and lines[-1] == "Caption: keep"
    bare = dataclasses.replace(page, links=[])
    assert with_caption_link(result, bare, world, random.Random(0)) == result


def test_bad_requests_are_clear_errors(world):
    with pytest.raises(ValueError, match="count >= 0"):
        lookup_drills(world, -1)
    with pytest.raises(ValueError, match="every entity is excluded"):
        lookup_drills(world, 1, excluded={p.id for p in world.graph.entities()})
    with pytest.raises(ValueError, match="visual_fraction"):
        lookup_drills(world, 1, visual_fraction=1.5)
    with pytest.raises(ValueError, match="max_guess_rate in \\(0, 1\\], got 0.0"):
        lookup_drills(world, 1, max_guess_rate=0.0)
    with pytest.raises(ValueError, match="caption_link_fraction in \\[0, 1\\], got -0.5"):
        lookup_drills(world, 1, caption_link_fraction=-0.5)
    with pytest.raises(ValueError, match="anchors not in the world: \\['no_such_page'\\]"):
        lookup_drills(world, 1, anchors=["no_such_page"])
    graph = world.graph
    keep = sorted(p.id for p in graph.entities())[:2]  # two entities cannot make 50 distinct drills
    with pytest.raises(ValueError, match="distinct drills"):
        lookup_drills(world, 50, excluded={p.id for p in graph.entities()} - set(keep))


def test_cli_leaves_out_the_rl_items_entities(world, curated, tmp_path, capsys):
    out, _ = curated
    target = tmp_path / "drills.jsonl"
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--count", "25", "--out", str(target)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rl_nodes = {n for item in read_items(out / "items.jsonl") if is_rl(item.id, CurationConfig()) for n in item.path}
    assert report["drills"] == 25 and report["excluded_rl_entities"] == len(rl_nodes) > 0
    rl_titles = {world.graph[n].title for n in rl_nodes}
    drills = list(read_jsonl(target))
    assert len(drills) == 25
    for drill in drills:
        assert not any(
            step.tool_call and step.tool_call.arguments.get("query", "").startswith(tuple(t + " " for t in rl_titles))
            for step in drill.steps
        )
    with pytest.raises(SystemExit):
        main(["drills", "--world", str(world.root), "--data", str(tmp_path), "--count", "1", "--out", str(target)])
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--caption-links", "1.5", "--out", str(tmp_path / "bad.jsonl")])
    assert "caption_link_fraction in [0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()


def test_cli_writes_held_out_prompts_anchored_on_the_rl_items(world, curated, tmp_path, capsys):
    out, _ = curated
    target = tmp_path / "rl_short" / "prompts.jsonl"
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--count", "12", "--out", str(target)]
    assert main(argv + ["--held-out-prompts"]) == 0
    report = json.loads(capsys.readouterr().out)
    rl_anchors = {item.path[0] for item in read_items(out / "items.jsonl") if is_rl(item.id, CurationConfig())}
    assert report == {"prompts": 12, "rl_anchors": len(rl_anchors), "anchors": "all", "out": str(target)}
    prompts = list(read_prompts(target))  # images are stored beside the file, by content hash
    assert len(prompts) == 12 and all(p.id.split("-")[2] in rl_anchors and p.images for p in prompts)
    assert all(p.anchor == p.id.split("-")[2] and p.hops >= 1 for p in prompts)  # kept through the file
    assert main(argv + ["--held-out-prompts", "--max-guess-rate", "0.15"]) == 0  # a rerun replaces the file
    rates = guess_rates(world)
    prompts = list(read_prompts(target))
    assert len(prompts) == 12 and all(rates[_asked(p, world)] <= 0.15 for p in prompts)
    before = target.read_bytes()
    with pytest.raises(SystemExit):  # a request the generator refuses: the previous file stays
        main(argv + ["--held-out-prompts", "--search-top-k", "-1"])
    assert target.read_bytes() == before


def test_split_anchors_is_fixed_disjoint_and_complete():
    anchors = [f"a{i}" for i in range(10)]
    train, held = split_anchors(reversed(anchors), 0.3)
    assert (len(train), len(held)) == (7, 3) and sorted(train + held) == anchors
    assert split_anchors(anchors, 0.3) == (train, held)  # order of the input does not matter
    assert split_anchors(anchors, 0.3, seed=1) != (train, held)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="eval_fraction"):
            split_anchors(anchors, bad)
    with pytest.raises(ValueError, match="one side would be empty"):
        split_anchors(["a", "b"], 0.1)


def test_cli_writes_training_and_evaluation_questions_on_disjoint_anchors(world, curated, tmp_path, capsys):
    out, _ = curated
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--count", "10", "--held-out-prompts"]
    starts = {}
    for side, seed in (("train", "1"), ("eval", "2")):
        target = tmp_path / side / "prompts.jsonl"
        assert main([*argv, "--anchors", side, "--seed", seed, "--out", str(target)]) == 0
        assert json.loads(capsys.readouterr().out)["anchors"] == side
        starts[side] = {p.id.split("-")[2] for p in read_prompts(target)}
    assert starts["train"] and starts["eval"] and not starts["train"] & starts["eval"]
    with pytest.raises(SystemExit):  # the split is of held-out question anchors only
        main(
            [
                "drills",
                "--world",
                str(world.root),
                "--data",
                str(out),
                "--count",
                "1",
                "--anchors",
                "eval",
                "--out",
                str(tmp_path / "x.jsonl"),
            ]
        )


def test_cli_drills_a_world_other_than_the_agents_without_a_curated_set(world, tmp_path, capsys):
    target = tmp_path / "other.jsonl"
    assert main(["drills", "--world", str(world.root), "--count", "8", "--out", str(target)]) == 0
    assert json.loads(capsys.readouterr().out) == {"drills": 8, "excluded_rl_entities": 0, "out": str(target)}
    assert len(list(read_jsonl(target))) == 8
    with pytest.raises(SystemExit):  # held-out questions start at a curated set's RL entities
        main(["drills", "--world", str(world.root), "--count", "1", "--held-out-prompts", "--out", str(target)])


def test_name_drills_make_every_name_a_target_and_state_no_fact(world):
    titles = {page.title for page in world.graph.entities()}
    drills = name_drills(world, len(titles) // 3 + 1, seed=4)  # at least 3 names each: one whole shuffle
    seen = [name for d in drills for name in d.steps[0].response.split("; ")]
    assert set(seen) == titles  # the names cycle through shuffles: all of them come back within one pass
    for drill in drills:
        (step,) = drill.steps
        listed = drill.prompt.question.removeprefix("Repeat these names: ").removesuffix(".")
        assert step.response == listed == drill.prompt.answer and step.tool_call is None
        assert 3 <= len(listed.split("; ")) <= 6 and " of " not in step.think  # no relation, no attribute
    assert name_drills(world, 5, seed=4)[0].prompt.question == drills[0].prompt.question  # seeded
    with pytest.raises(ValueError, match="names"):
        name_drills(world, 1, names=(0, 2))


def test_cli_writes_name_drills_without_a_curated_set(world, tmp_path, capsys):
    target = tmp_path / "names.jsonl"
    assert main(["drills", "--world", str(world.root), "--names", "--count", "6", "--out", str(target)]) == 0
    assert json.loads(capsys.readouterr().out)["drills"] == 6
    assert all(t.prompt.id.startswith("names-") for t in read_jsonl(target))
    with pytest.raises(SystemExit):
        main(
            [
                "drills",
                "--world",
                str(world.root),
                "--names",
                "--held-out-prompts",
                "--count",
                "1",
                "--out",
                str(target),
            ]
        )


def test_cli_pilot_anchors_cut_the_training_side_in_two_that_share_nothing(world, curated, tmp_path, capsys):
    out, _ = curated
    rl_anchors = {item.path[0] for item in read_items(out / "items.jsonl") if is_rl(item.id, CurationConfig())}
    train, held = split_anchors(rl_anchors, 0.5)
    starts, sizes = {}, {}
    for side in ("train-fit", "train-val"):
        target = tmp_path / f"{side}.jsonl"
        argv = ["drills", "--world", str(world.root), "--data", str(out), "--held-out-prompts", "--count", "8"]
        assert main([*argv, "--anchors", side, "--out", str(target)]) == 0
        sizes[side] = json.loads(capsys.readouterr().out)["rl_anchors"]
        starts[side] = {p.id.split("-")[2] for p in read_prompts(target)}
    assert sizes["train-fit"] + sizes["train-val"] == len(train) and min(sizes.values()) > 0
    assert starts["train-fit"] | starts["train-val"] <= set(train)  # never an evaluation entity
    assert not starts["train-fit"] & starts["train-val"]


def _relation_hops(drill) -> int:
    """The relation lookups before the attribute's: every text search but the last."""
    return sum(s.tool_call is not None and s.tool_call.name == "text_search" for s in drill.steps) - 1


def test_cli_max_hops_bounds_the_relation_hops_of_drills_and_questions(world, curated, tmp_path, capsys):
    out, _ = curated
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--count", "30"]

    for max_hops, expected in ((1, {1}), (2, {1, 2})):
        target = tmp_path / f"drills{max_hops}.jsonl"
        assert main([*argv, "--max-hops", str(max_hops), "--out", str(target)]) == 0
        assert {_relation_hops(d) for d in read_jsonl(target)} == expected
    questions = tmp_path / "questions.jsonl"
    assert main([*argv[:-1], "12", "--held-out-prompts", "--max-hops", "1", "--out", str(questions)]) == 0
    assert {p.question.count(" of the ") for p in read_prompts(questions)} == {2}  # attribute, relation, "shown"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--max-hops", "0", "--out", str(tmp_path / "bad.jsonl")])
    assert "max_hops >= 1" in capsys.readouterr().err and not (tmp_path / "bad.jsonl").exists()


def test_hop_quota_splits_the_count_exactly_by_largest_remainders():
    assert hop_quota(6000, 2, (0.75, 0.25)) == {1: 4500, 2: 1500}
    assert hop_quota(10, 3, (1 / 3, 1 / 3, 1 / 3)) == {1: 4, 2: 3, 3: 3}
    assert hop_quota(7, 2, (0.5, 0.5)) == {1: 4, 2: 3} and hop_quota(5, 2, None) is None
    for bad in ((0.5,), (0.5, 0.6), (1.2, -0.2)):
        with pytest.raises(ValueError, match="one share in"):
            hop_quota(10, 2, bad)


def test_hop_shares_give_exact_hop_counts(world):
    drills = lookup_drills(world, 20, seed=1, hop_shares=(0.75, 0.25))
    assert Counter(_relation_hops(d) for d in drills) == {1: 15, 2: 5}
    assert len({d.prompt.id for d in drills}) == 20


def test_cli_hop_shares_write_exact_hop_counts_and_refuse_bad_shares(world, curated, tmp_path, capsys):
    out, _ = curated
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--count", "16"]
    target = tmp_path / "drills.jsonl"
    assert main([*argv, "--hop-shares", "0.5,0.5", "--out", str(target)]) == 0
    assert Counter(_relation_hops(d) for d in read_jsonl(target)) == {1: 8, 2: 8}
    capsys.readouterr()
    for extra, message in (
        (["--hop-shares", "0.5,x"], "comma-separated numbers"),
        (["--hop-shares", "0.6,0.6"], "summing to 1"),
        (["--hop-shares", "0.5,0.5", "--max-hops", "3"], "per hop count 1..3"),
        (["--hop-shares", "1", "--names"], "does not combine"),
    ):
        with pytest.raises(SystemExit):
            main([*argv, *extra, "--out", str(tmp_path / "bad.jsonl")])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()


def test_cli_held_out_prompts_take_hop_shares_for_a_longer_chain_probe(world, curated, tmp_path):
    out, _ = curated
    target = tmp_path / "three_hop.jsonl"
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--held-out-prompts", "--count", "6"]
    assert main([*argv, "--hop-shares", "0,0,1", "--out", str(target)]) == 0
    hops = [json.loads(line)["hops"] for line in target.read_text().splitlines()]
    assert hops == [3] * 6
    mixed = tmp_path / "mixed.jsonl"
    assert main([*argv, "--max-hops", "3", "--out", str(mixed)]) == 0
    assert {json.loads(line)["hops"] for line in mixed.read_text().splitlines()} != {3}


def _sound_steps(drill) -> list[tuple]:
    """What a drill does with the failed attempts taken out: calls, observations, answer."""
    return [
        (s.tool_call, s.observation_text, s.response) for s in drill.steps if s.tool_result is None or s.tool_result.ok
    ]


def test_tool_faults_fail_a_call_first_and_the_expert_makes_the_same_call_again(world):
    plain = lookup_drills(world, 30, seed=2)
    faulted = lookup_drills(world, 30, seed=2, tool_fault_rate=0.3)
    # the faults are drawn apart from the drills: the same questions
    assert [(d.prompt.id, d.prompt.question) for d in faulted] == [(d.prompt.id, d.prompt.question) for d in plain]
    retried = 0
    for before, after in zip(plain, faulted, strict=True):
        assert _sound_steps(after) == _sound_steps(before)
        run = 0
        for step, following in itertools.pairwise(after.steps):
            if step.tool_result is not None and not step.tool_result.ok:
                run += 1
                # the text a rollout shows after an injected fault (tests/test_demo.py checks the same text)
                assert step.tool_result.status is ToolStatus.TOOL_ERROR
                assert step.observation_text == "Error (tool_error): injected fault"
                assert following.tool_call == step.tool_call and following.think == RETRY_THINK
                assert following.text == step.text.replace(
                    f"<think>{step.think}</think>", f"<think>{RETRY_THINK}</think>"
                )
                assert run <= 2
            else:
                run = 0
        retried += len(after.steps) > len(before.steps)
        assert not is_fatal(trajectory_fatal_step(after))  # two failures in a row at most: K=3 never fires
    assert 0 < retried < len(plain)


def test_with_tool_faults_at_the_edges(world):
    (drill,) = lookup_drills(world, 1, seed=4)
    calls = [s for s in drill.steps if s.tool_call is not None]
    assert with_tool_faults(drill, 0.0, random.Random(0)).steps == drill.steps
    every = with_tool_faults(drill, 1.0, random.Random(0), max_consecutive=2)
    assert len(every.steps) == len(drill.steps) + 2 * len(calls)
    assert [s.tool_result.ok for s in every.steps[:3]] == [False, False, True]
    assert every.steps[0].think == drill.steps[0].think and every.steps[1].think == RETRY_THINK
    assert every.steps[-1] is drill.steps[-1]  # the answer is untouched
    for rate, consecutive in ((1.5, 2), (0.5, -1)):
        with pytest.raises(ValueError, match="rate in \\[0, 1\\] and max_consecutive >= 0"):
            with_tool_faults(drill, rate, random.Random(0), consecutive)
    with pytest.raises(ValueError, match="tool_fault_rate in \\[0, 1\\], got -0.1"):
        lookup_drills(world, 1, tool_fault_rate=-0.1)


def test_cli_tool_faults_write_the_same_drills_with_retries(world, curated, tmp_path, capsys):
    out, _ = curated
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--count", "20"]
    assert main([*argv, "--out", str(tmp_path / "plain.jsonl")]) == 0
    assert main([*argv, "--tool-faults", "0.5", "--out", str(tmp_path / "faulted.jsonl")]) == 0
    plain, faulted = list(read_jsonl(tmp_path / "plain.jsonl")), list(read_jsonl(tmp_path / "faulted.jsonl"))
    assert [d.prompt.id for d in plain] == [d.prompt.id for d in faulted]
    assert [_sound_steps(d) for d in plain] == [_sound_steps(d) for d in faulted]
    assert sum(s.think == RETRY_THINK for d in faulted for s in d.steps) > 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--names", "--tool-faults", "0.5", "--out", str(tmp_path / "bad.jsonl")])
    assert "--tool-faults shapes lookup drills" in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()


def _texts(drill) -> list[tuple[str, str]]:
    return [(s.text, s.observation_text) for s in drill.steps]


def test_recall_answers_that_share_of_the_longest_drills_without_the_lookup(world):
    plain = lookup_drills(world, 40, seed=2, hop_shares=(0.5, 0.5))
    every = lookup_drills(world, 40, seed=2, hop_shares=(0.5, 0.5), recall_fraction=1.0)
    half = lookup_drills(world, 40, seed=2, hop_shares=(0.5, 0.5), recall_fraction=0.5)
    # drawn apart from the drills: the same questions, answers and hop counts
    questions = [(d.prompt.id, d.prompt.question, d.prompt.answer) for d in plain]
    assert [(d.prompt.id, d.prompt.question, d.prompt.answer) for d in every] == questions
    assert [(d.prompt.id, d.prompt.question, d.prompt.answer) for d in half] == questions
    recalled = 0
    for before, after, some in zip(plain, every, half, strict=True):
        if _relation_hops(before) == 1:
            assert _texts(after) == _texts(before) == _texts(some)
            continue
        lookup = before.steps[-2]
        assert lookup.tool_call.name == "text_search" and after.prompt.answer in lookup.observation_text
        assert _texts(after) == [*_texts(before)[:-2], _texts(before)[-1]]  # the lookup gone, the same answer
        assert not any(after.prompt.answer in s.observation_text for s in after.steps)  # read nowhere now
        assert _texts(some) in (_texts(before), _texts(after))
        recalled += _texts(some) == _texts(after)
    assert 0 < recalled < 20  # 20 two-hop drills, about half of them recalled


def test_recall_then_tool_faults_retry_only_the_calls_left(world):
    recalled = lookup_drills(world, 20, seed=5, recall_fraction=1.0, hop_shares=(0.0, 1.0))
    faulted = lookup_drills(world, 20, seed=5, recall_fraction=1.0, hop_shares=(0.0, 1.0), tool_fault_rate=0.5)
    assert [_sound_steps(d) for d in faulted] == [_sound_steps(d) for d in recalled]
    assert all(d.steps[-1].response == d.prompt.answer for d in faulted)


def test_with_recalled_answer_refuses_a_drill_without_a_final_lookup(world):
    (drill,) = lookup_drills(world, 1, seed=4)
    once = with_recalled_answer(drill)
    with pytest.raises(ValueError, match="ending in a lookup and its answer"):
        with_recalled_answer(dataclasses.replace(drill, steps=drill.steps[:-1]))
    assert once.steps[-1] is drill.steps[-1]
    with pytest.raises(ValueError, match="recall_fraction in \\[0, 1\\], got 1.5"):
        lookup_drills(world, 1, recall_fraction=1.5)


def test_cli_recall_writes_recalled_drills_and_refuses_other_outputs(world, curated, tmp_path, capsys):
    out, _ = curated
    argv = ["drills", "--world", str(world.root), "--data", str(out), "--count", "16", "--hop-shares", "0.5,0.5"]
    assert main([*argv, "--out", str(tmp_path / "plain.jsonl")]) == 0
    assert main([*argv, "--recall", "1", "--out", str(tmp_path / "recalled.jsonl")]) == 0
    plain, recalled = list(read_jsonl(tmp_path / "plain.jsonl")), list(read_jsonl(tmp_path / "recalled.jsonl"))
    assert [d.prompt.id for d in plain] == [d.prompt.id for d in recalled]
    assert sum(len(a.steps) - len(b.steps) for a, b in zip(plain, recalled, strict=True)) == 8  # 8 lookups dropped
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--names", "--recall", "0.5", "--out", str(tmp_path / "bad.jsonl")])
    assert "--recall shapes lookup drills" in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()
