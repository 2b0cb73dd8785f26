"""``python -m osvl.synth run`` end to end: the default path unchanged, a graph source, and every
LLM stage sent to a loopback OpenAI-compatible server chosen by flags and config alone, through
outages that stop the run and resume it with nothing lost."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable

import pytest

from osvl.rl.trajectory import read_jsonl, read_prompts
from osvl.synth.__main__ import STOPPED, main
from osvl.synth.pipeline import SYNTHESIS_PROGRESS, CurationConfig, curate
from osvl.synth.records import read_items

from .chat_server import LoopbackChat, message_text

_ENTITY = re.compile(r'^Entity: (.*)\n(?:.|\n)*It is the "(.*)" of the previous entity', re.MULTILINE)
_EVALUATE = re.compile(r'^Question: (.*)\nConsider the phrase "(.*)" inside the question', re.MULTILINE)
_RECORD = re.compile(r"\(record ([0-9a-f]{8})\)")


def _tree(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class WorldModel:
    """A scripted 'LLM' that knows the world graph: it proposes ``the <relation> of {prev}
    (record <hash>)`` descriptors, judges them unique, has no closed-book knowledge, and as the
    expert searches the image, then the attribute, then answers. ``down(kind, n)`` makes the
    n-th request of a kind fail with 503 (an outage)."""

    def __init__(self, graph, down: Callable[[str, int], bool] = lambda kind, n: False) -> None:
        self.graph, self.down = graph, down
        self.by_title = {p.title: p.id for p in graph.entities()}
        self.records = {hashlib.sha1(pid.encode()).hexdigest()[:8]: pid for pid in self.by_title.values()}
        self.requests: Counter[str] = Counter()
        self.server: LoopbackChat | None = None

    def answer(self, question: str) -> tuple[str, str]:
        """(attribute, value) of the question's answer node: the last record it names."""
        node = self.graph[self.records[_RECORD.findall(question)[-1]]]
        key = max((k for k in node.infobox if f"the {k} of " in question), key=len)
        return key, node.infobox[key]

    def __call__(self, prompt: str) -> tuple[int, str]:
        messages = self.server.bodies[-1]["messages"]
        kind = (
            "expert"
            if messages[0]["role"] == "system"
            else "rewrite"
            if prompt.startswith("You rewrite")
            else "closed_book"
            if prompt.startswith("Answer the question")
            else "image_search"
            if prompt.startswith("You may not search further")
            else "uniqueness"
        )
        self.requests[kind] += 1
        if self.down(kind, self.requests[kind]):
            return 503, "overloaded"
        if kind == "rewrite":
            title, relation = _ENTITY.search(prompt).groups()
            token = hashlib.sha1(self.by_title[title].encode()).hexdigest()[:8]
            return 200, json.dumps({"descriptors": [f"the {relation} of {{prev}} (record {token})"]})
        if kind == "uniqueness":
            question, phrase = _EVALUATE.search(prompt).groups()
            entity = self.graph[self.records[_RECORD.findall(phrase)[-1]]].title
            return 200, json.dumps({"compatible": [entity], "answer": self.answer(question)[1]})
        if kind in ("closed_book", "image_search"):
            return 200, json.dumps({"answer": None})
        question = message_text(messages[1]["content"])
        key, value = self.answer(question)
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns == 0:
            call = {"name": "image_search", "arguments": {"image": 0, "top_k": 1}}
        elif turns == 1:
            call = {"name": "text_search", "arguments": {"query": f"{key} of the entity in the image"}}
        else:
            return 200, f"<think>The search settles it.</think>\n<response>{value}</response>"
        return 200, f"<think>I search next.</think>\n<tool_call>{json.dumps(call)}</tool_call>"


def _llm_argv(world, server, out, config) -> list[str]:
    return [
        "run",
        "--world",
        str(world.root),
        "--out",
        str(out),
        "--config",
        str(config),
        "--llm-url",
        server.base_url,
        "--llm-model",
        "loopback-expert",
        "--llm-stages",
        "rewrite,uniqueness,filter,expert",
    ]


@pytest.fixture(scope="module")
def llm_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "loopback.toml"
    path.write_text(
        "[llm]\nmax_attempts = 1\n\n[curation]\nper_domain = 2\nobfuscate_prob = 0.0\n"
        "rollouts_per_item = 1\ntext_search_filter = false\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def llm_run(world, llm_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("llm_run")
    model = WorldModel(world.graph)
    with LoopbackChat(model) as server:
        model.server = server
        code = main(_llm_argv(world, server, out, llm_config))
    return out, code, model


def test_cli_default_run_is_byte_identical_to_curate(world, curated, tmp_path, capsys):
    out, counts = curated
    assert main(["run", "--world", str(world.root), "--out", str(tmp_path / "cli")]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(counts))
    assert _tree(tmp_path / "cli") == _tree(out)


def test_graph_source_curates_like_the_world_it_came_from(world, tmp_path):
    config = tmp_path / "graph.toml"
    config.write_text(
        f"[source]\nhub_threshold = {world.sampling.hub_threshold}\n"
        f"min_seed_in_degree = {world.sampling.min_seed_in_degree}\n\n"
        "[curation]\nper_domain = 2\n",
        encoding="utf-8",
    )
    assert (
        main(
            [
                "run",
                "--config",
                str(config),
                "--graph",
                str(world.root / "graph.jsonl"),
                "--images",
                str(world.root),
                "--out",
                str(tmp_path / "graph"),
            ]
        )
        == 0
    )
    curate(world, tmp_path / "world", CurationConfig(per_domain=2))
    for name in ("candidates.jsonl", "items.jsonl", "rl/prompts.jsonl", "sft/trajectories.jsonl"):
        assert (tmp_path / "graph" / name).read_bytes() == (tmp_path / "world" / name).read_bytes(), name
    collection = [json.loads(line) for line in (tmp_path / "graph" / "source_images.jsonl").open()]
    assert len(collection) == sum(1 for _ in world.images()) and all(r["image"].startswith("/") for r in collection)


def test_every_configured_stage_called_the_llm_and_records_came_out(world, llm_run):
    out, code, model = llm_run
    assert code == 0
    counts = json.loads((out / "curation.json").read_text())
    assert "stopped" not in counts
    assert set(counts["llm"]["calls"]) == {"rewrite", "uniqueness", "closed_book", "image_search", "expert"}
    assert all(model.requests[k] == n for k, n in counts["llm"]["calls"].items())
    items = list(read_items(out / "items.jsonl"))
    assert items and counts["no_tools"]["in"] == counts["llm"]["calls"]["closed_book"]
    assert counts["single_image_search"]["in"] == counts["llm"]["calls"]["image_search"]
    for item in items:  # the LLM's descriptors, not the graph proposer's, made every question
        assert len(_RECORD.findall(item.text)) == item.hops
        assert all(e["verdict"] == "ok" for e in item.rewrite_log)
    trajectories = list(read_jsonl(out / "sft" / "trajectories.jsonl"))
    assert trajectories and counts["synthesize"]["kept"] == len(trajectories)
    for trajectory in trajectories:
        assert [s.tool_call.name for s in trajectory.steps[:-1]] == ["image_search", "text_search"]
        assert trajectory.final_answer == trajectory.prompt.answer
    assert counts["synthesize"]["sft_items"] + counts["synthesize"]["rl_items"] == len(items)
    assert len(list(read_prompts(out / "rl" / "prompts.jsonl"))) == counts["synthesize"]["rl_items"]


def test_an_outage_stops_the_run_and_a_rerun_loses_nothing(world, llm_config, llm_run, tmp_path, capsys):
    reference, _, _ = llm_run
    out = tmp_path / "outage"
    schedule = {"uniqueness": 5}  # the 5th uniqueness request of the first run fails

    model = WorldModel(world.graph, down=lambda kind, n: schedule.get(kind) == n)
    with LoopbackChat(model) as server:
        model.server = server
        argv = _llm_argv(world, server, out, llm_config)
        assert main(argv) == STOPPED
        counts = json.loads((out / "curation.json").read_text())
        assert counts["stopped"]["stage"] == "sample" and "http_503" in counts["stopped"]["error"]
        assert counts["llm"]["failures"] == {"uniqueness": 1}
        assert "rerun the same command to resume" in capsys.readouterr().err
        assert "sample" not in counts and (out / "candidates.jsonl").read_text().count("\n") >= 1  # decided seeds kept
        model.requests.clear()
        schedule.clear()
        schedule["expert"] = 4  # now the expert goes down mid-synthesis
        assert main(argv) == STOPPED
        counts = json.loads((out / "curation.json").read_text())
        assert counts["stopped"]["stage"] == "synthesize" and (out / SYNTHESIS_PROGRESS).is_file()
        assert counts["llm"]["failures"] == {"expert": 1}
        schedule.clear()
        assert main(argv) == 0
    assert not (out / SYNTHESIS_PROGRESS).exists()
    for name in (
        "candidates.jsonl",
        "candidates.jsonl.drops.jsonl",
        "items.jsonl",
        "rl/prompts.jsonl",
        "synthesis.json",
    ):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    ours, theirs = (list(read_jsonl(d / "sft" / "trajectories.jsonl")) for d in (out, reference))
    assert [(t.prompt.id, [s.text for s in t.steps]) for t in ours] == [
        (t.prompt.id, [s.text for s in t.steps]) for t in theirs
    ]
