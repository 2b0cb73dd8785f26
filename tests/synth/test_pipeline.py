"""The whole curation pipeline on the mini-world: the issue's evidence, checked against the world."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from osvl.rl.offline_judges import normalize_answer
from osvl.rl.trajectory import read_jsonl, read_prompts
from osvl.synth.__main__ import main
from osvl.synth.pipeline import CurationConfig, curate
from osvl.synth.question import Mention
from osvl.synth.records import read_items
from osvl.synth.stats import curation_stats, leaks

_CALL = re.compile(r"^<think>.+</think>\n<tool_call>(\{.*\})</tool_call>$", re.DOTALL)
_ANSWER = re.compile(r"^<think>.+</think>\n<response>(.+)</response>$", re.DOTALL)


def test_stats_meet_the_issue_evidence(world, curated):
    out, _ = curated
    stats = curation_stats(world, out)
    assert stats["leak_rate"] == 0.0 and stats["uniqueness_rate"] == 1.0
    assert stats["answerable_with_image_search_plus_text_search"] == 0
    assert stats["items"] >= 50 and set(stats["hops"]) == {2, 3, 4}
    share = {h: n / sum(stats["candidate_hops"].values()) for h, n in stats["candidate_hops"].items()}
    assert abs(share[2] - 0.4) < 0.1 and abs(share[3] - 0.4) < 0.1 and abs(share[4] - 0.2) < 0.1
    assert stats["rl_items"] > 10 and stats["sft_items"] > 20 and stats["rl_sft_overlap"] == 0
    assert 0 < sum(stats["degraded"].values()) <= 0.2 * stats["items"]
    filters = stats["filters"]
    assert filters["no_tools"]["dropped"]["answerable_without_tools"] > 0
    assert filters["one_image_search"]["dropped"]["solvable_with_one_image_search"] > 0
    for counts in filters.values():
        assert counts["in"] == counts["kept"] + sum(counts["dropped"].values())
    assert filters["no_tools"]["in"] == filters["grounded"]["kept"]


def test_cli_stats_prints_the_same_numbers(world, curated, capsys):
    out, _ = curated
    assert main(["stats", "--world", str(world.root), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["leak_rate"] == 0.0 and printed["items"] == curation_stats(world, out)["items"]


def test_cli_run_resumes_a_finished_curation(world, curated, capsys):
    out, counts = curated
    assert main(["run", "--world", str(world.root), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(counts))


def test_items_are_grounded_at_the_anchor(world, curated):
    out, _ = curated
    for item in read_items(out / "items.jsonl"):
        assert item.question.mentions[0].visual and item.image == f"images/{item.path[0]}.png"
        assert item.path[0] not in item.text and item.grounding_score >= 0.5
        assert len(item.answer.split()) <= 6 and item.answer
        if item.degradation:
            assert item.degradation["repair_tool"] in {"sharpen", "super_resolution", "perspective_correct"}
            assert (out / item.degradation["image"]).is_file()


def test_sft_trajectories_are_well_formed_and_correct(world, curated):
    out, _ = curated
    items = {i.id: i for i in read_items(out / "items.jsonl")}
    trajectories = list(read_jsonl(out / "sft" / "trajectories.jsonl"))
    assert trajectories
    for traj in trajectories:
        item = items[traj.prompt.id]
        assert normalize_answer(traj.final_answer) == normalize_answer(item.answer)
        *calls, last = traj.steps
        assert _ANSWER.match(last.text).group(1) == traj.final_answer
        for step in calls:
            body = json.loads(_CALL.match(step.text).group(1))
            assert body == {"name": step.tool_call.name, "arguments": step.tool_call.arguments}
            assert step.tool_result.ok and step.token_ids == [] and step.logprobs == []
        first = calls[0].tool_call.name
        assert first == (item.degradation["repair_tool"] if item.degradation else "image_search")
        assert len(calls) >= item.hops + 2  # image search, one search per hop, the attribute lookup
        assert traj.prompt.images[0].dtype == np.uint8


def test_rl_prompts_are_disjoint_and_carry_the_image(curated):
    out, _ = curated
    prompts = list(read_prompts(out / "rl" / "prompts.jsonl"))
    sft_ids = {t.prompt.id for t in read_jsonl(out / "sft" / "trajectories.jsonl")}
    assert prompts and not ({p.id for p in prompts} & sft_ids)
    for prompt in prompts:
        assert prompt.images and prompt.answer and "shown in the image" in prompt.question


def test_rerun_resumes_without_duplicates(world, curated):
    out, counts = curated
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("*.jsonl")}
    again = curate(world, out, CurationConfig(seed=0))
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("*.jsonl")}
    assert again == counts and before == after


def test_leak_detector_flags_a_named_anchor(world, curated):
    out, _ = curated
    item = next(read_items(out / "items.jsonl"))
    assert leaks(world, item) == []
    named = item.question.with_mention(0, Mention(name=world.graph[item.path[0]].title))
    item.question = named
    assert leaks(world, item) == [world.graph[item.path[0]].title]


def test_cli_run_validates_the_expert_tools_choice(world, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--world", str(world.root), "--out", str(tmp_path), "--expert-tools", "web"])
    assert "invalid choice: 'web'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # rejected before anything was written
