"""The real tool environment over the mini-world: the scripted expert and the ImageSearch solver."""

from __future__ import annotations

import random
import shutil
from dataclasses import replace

import numpy as np
import pytest

from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.trajectory import ToolCall, ToolResult, ToolStatus, read_jsonl
from osvl.synth.environment import EnvironmentTools
from osvl.synth.expert import (
    ExpertConfig,
    ScriptedExpert,
    SynthesisReport,
    read_passages,
    synthesize,
    top_match_page,
)
from osvl.synth.filtering import ImageSearchSolver, SolverAnswer, images_by_page, solved
from osvl.synth.pipeline import CurationConfig, curate, load_rgb, question_image
from osvl.synth.records import read_items
from osvl.synth.tool_solvers import (
    SolverUnavailable,
    ToolImageSearchSolver,
    caption_facts,
)
from osvl.tools import ToolEnvironment, default_registry
from osvl.tools.world import world_tools_config


def test_world_tools_config_points_at_the_world(world, tmp_path):
    config = world_tools_config(world, tmp_path / "index.sqlite")
    assert config.text_search.corpus_path == str(world.corpus_path)
    assert config.text_search.index_path == str(tmp_path / "index.sqlite")
    assert config.image_search.collection_path == str(world.images_path)
    moved = replace(world, corpus_path=tmp_path / "corpus.jsonl")
    with pytest.raises(ValueError, match="no corpus.jsonl"):
        world_tools_config(moved)


def test_world_tools_config_takes_a_world_directory(world, tmp_path):
    """The recipes' tools.world_dir and the tool server's --world name the directory, not a loaded world."""
    config = world_tools_config(world.root)
    assert config.text_search.corpus_path == str(world.root / "corpus.jsonl")
    assert config.image_search.collection_path == str(world.root / "images.jsonl")
    assert config.text_search.index_path is None
    with pytest.raises(ValueError, match=f"world {tmp_path} has no corpus.jsonl; build it with"):
        world_tools_config(tmp_path)


def test_real_search_observations_parse(world, real_tools):
    page = next(p for p in world.graph.entities() if p.domain == "Building/Place")
    text = real_tools(ToolCall("text_search", {"query": f"{page.title} architect"}), [])
    assert text.status is ToolStatus.OK and text.elapsed_s > 0
    assert (page.id, page.title) in [(pid, title) for pid, title, _ in read_passages(text.text)]
    record = next(r for r in world.images() if r.width >= 512)
    found = real_tools(ToolCall("image_search", {"image": 0, "top_k": 1}), [world.load_image(record.page_id)])
    assert found.status is ToolStatus.OK and top_match_page(found.text) == record.page_id
    assert "near_duplicate" in found.text  # the pHash stage of the real index answered


def test_real_tool_errors_are_statuses(real_tools):
    bad_index = real_tools(ToolCall("image_search", {"image": 3}), [np.zeros((8, 8, 3), np.uint8)])
    assert bad_index.status is ToolStatus.TOOL_ERROR and "does not exist" in bad_index.error
    unknown = real_tools(ToolCall("teleport", {}), [])
    assert unknown.status is ToolStatus.PARSE_ERROR

    class Crashing:
        def call(self, job) -> ToolResult:
            raise RuntimeError("pool died")

    crashed = EnvironmentTools(ToolEnvironment(default_registry(), Crashing()))
    result = crashed(ToolCall("text_search", {"query": "x"}), [])
    assert result.status is ToolStatus.INFRA_ERROR and "pool died" in result.error


def test_scripted_expert_with_real_tools_writes_real_observations(world, curated, real_tools):
    out, _ = curated
    items = list(read_items(out / "items.jsonl"))
    chosen = [i for i in items if i.degradation is not None][:1] + [i for i in items if i.degradation is None][:4]
    expert = ScriptedExpert(world.graph, real_tools, ExpertConfig(slip_prob=0.0, repeat_prob=0.0))
    report, kept = SynthesisReport(), []
    for group, item in enumerate(chosen):
        kept += synthesize(
            item,
            question_image(world, out, item),
            expert,
            1,
            random.Random(group),
            ExactMatchAccuracyJudge(),
            HeuristicQueryJudge(),
            0.97,
            report,
            group,
        )
    assert report.rollouts == len(chosen) and report.kept == len(kept) >= 2
    assert report.kept + report.rejected_answer + report.rejected_process == len(chosen)
    for trajectory in kept:
        observations = "\n".join(s.observation_text for s in trajectory.steps)
        assert "[Match 1]" in observations and "URL: world://" in observations
        assert all(s.tool_result.elapsed_s > 0 for s in trajectory.steps[:-1])  # really executed
    repair = next(
        s
        for s in expert.rollout(chosen[0], question_image(world, out, chosen[0]), random.Random(0))
        if s.tool_call and s.tool_call.name == chosen[0].degradation["repair_tool"]
    )
    assert repair.tool_result.ok and len(repair.observation_images) == 1


def test_caption_facts():
    assert caption_facts("Vorka, a city; mayor: Kelpel Talzel") == [("mayor", "Kelpel Talzel")]
    assert caption_facts("Vorka, a city") == []
    assert caption_facts("Vorka, a city; nonsense; maker: A; : B") == [("maker", "A")]


def test_tool_image_search_solver_agrees_with_the_exact_one(world, curated, real_tools):
    out, _ = curated
    items = list(read_items(out / "no_tools.jsonl"))  # what reaches the single-ImageSearch stage
    config = CurationConfig()
    exact = ImageSearchSolver(world.graph, images_by_page(world.images()), config.fame_in_degree)
    real = ToolImageSearchSolver(
        world.graph, real_tools, lambda item: load_rgb(world.root / item.image), config.fame_in_degree
    )
    recognised = agree = exact_solved = 0
    for item in items:
        anchor, stated = real.recognise(item)  # the one real ImageSearch call
        recognised += anchor == item.path[0]
        exact_easy = solved(exact.solve(item), item)
        exact_solved += exact_easy
        agree += exact_easy == solved(real.answer(item, anchor, stated), item)
    print(
        f"\nreal ImageSearch solver: {len(items)} items, anchor recognised {recognised}/{len(items)}, "
        f"filter decision agrees {agree}/{len(items)} ({agree / len(items):.1%}); exact drops {exact_solved}"
    )
    assert recognised / len(items) >= 0.95
    assert agree / len(items) >= 0.95 and exact_solved >= 1


def test_tool_image_search_solver_failure_modes(world, curated):
    out, _ = curated
    item = next(iter(read_items(out / "no_tools.jsonl")))

    def executor(status: ToolStatus):
        return lambda call, images: ToolResult(status, call.name, error="backend down")

    down = ToolImageSearchSolver(
        world.graph, executor(ToolStatus.INFRA_ERROR), lambda i: np.zeros((8, 8, 3), np.uint8), 6
    )
    with pytest.raises(SolverUnavailable, match="backend down"):
        down.solve(item)
    no_match = ToolImageSearchSolver(
        world.graph, executor(ToolStatus.TOOL_ERROR), lambda i: np.zeros((8, 8, 3), np.uint8), 6
    )
    assert no_match.solve(item) == SolverAnswer(None, 1)
    with pytest.raises(ValueError, match="top_k"):
        ToolImageSearchSolver(world.graph, executor(ToolStatus.OK), lambda i: None, 6, top_k=0)


def test_curation_can_synthesize_with_the_real_tool_pool(world, curated, tmp_path):
    """``expert_tools="environment"``: the pipeline spawns its own pool; recorded observations carry
    the real tools' timings (the exact stand-ins record 0)."""
    source, _ = curated
    out = tmp_path / "curated"
    shutil.copytree(source, out)
    for stale in ("synthesis.json", "curation.json"):
        (out / stale).unlink()
    result = curate(world, out, CurationConfig(expert_tools="environment", rl_fraction=0.97, tool_workers=1))[
        "synthesize"
    ]
    assert result["sft_items"] >= 1 and result["rollouts"] == 2 * result["sft_items"]
    written = list(read_jsonl(out / "sft" / "trajectories.jsonl"))
    assert len(written) == result["kept"] >= 1
    assert all(s.tool_result.elapsed_s > 0 for t in written for s in t.steps[:-1])
    assert (out / "cache" / "corpus.fts5.sqlite").is_file()  # the index is built beside the output, not in the world
    with pytest.raises(ValueError, match="tool_workers"):
        CurationConfig(tool_workers=0)


def test_the_world_pool_preloads_every_tool_even_when_given_a_pool_config(real_tools):
    """A caller's PoolConfig (here one worker, no preload) still gets every tool imported before a call."""
    env = real_tools.env
    assert env.pool.config.num_workers == 1 and env.pool.config.preload == env.registry.targets()
