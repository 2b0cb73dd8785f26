"""The curation pipeline over a world, stage by stage, each a resumable JSONL-to-JSONL function.

``out/`` receives ``candidates.jsonl`` (sampled + rewritten), ``grounded.jsonl``, then one file
per filter (``no_tools.jsonl``, ``one_image_search.jsonl``, ``kept.jsonl``), ``items.jsonl``
(with the degradation subset), ``sft/trajectories.jsonl``, ``rl/prompts.jsonl`` and
``curation.json`` (all counts); each JSONL has a ``.counts.json`` beside it.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from osvl.rl.judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.trajectory import Prompt, append_jsonl
from osvl.synth.environment import world_environment
from osvl.synth.expert import (
    Expert,
    ExpertConfig,
    ScriptedExpert,
    SynthesisReport,
    WorldTools,
    synthesize,
)
from osvl.synth.filtering import (
    CachedSolver,
    ClosedBookSolver,
    ImageSearchSolver,
    Solver,
    SolverFilter,
    images_by_page,
)
from osvl.synth.grounding import AnchorGrounder, Degrader, MetadataScorer
from osvl.synth.question import render_question
from osvl.synth.records import Drop, QAItem, read_items, run_stage, write_prompts
from osvl.synth.rewrite import (
    ExactGraphEvaluator,
    GraphDescriptorProposer,
    canonical_question,
    rewrite,
)
from osvl.synth.sampling import (
    Rejection,
    SampledPath,
    SamplingConfig,
    sample_with_retries,
    stratified_seeds,
)
from osvl.tools import PoolConfig
from osvl.world.build import World
from osvl.world.render import stable_seed


@dataclass(frozen=True)
class CurationConfig:
    seed: int = 0
    per_domain: int = 1_000  # seeds per domain (all eligible ones in the mini-world)
    obfuscate_prob: float = 0.15
    fame_in_degree: int = 6  # entities at least this linked are "known" to closed-book solvers
    min_grounding_score: float = 0.5
    degrade_fraction: float = 0.1
    rl_fraction: float = 0.3  # share of seeds whose items go to RL (disjoint from SFT)
    rollouts_per_item: int = 2
    min_process_score: float = 0.97  # the offline heuristic: any repeated call costs > 0.03
    solver_budget: int | None = None
    # beyond the paper's two stages: also drop items one ImageSearch plus one TextSearch answer,
    # so every kept mini-world item needs the multi-hop chain
    text_search_filter: bool = True
    expert: ExpertConfig = field(default_factory=ExpertConfig)
    # the scripted expert's tools: "exact" in-process stand-ins (fast) or "environment", the real
    # tool pool over the world's corpus and images (observations as RL rollouts see them)
    expert_tools: str = "exact"
    tool_workers: int = 2  # processes of the real tool pool (each builds its own image index)

    def __post_init__(self) -> None:
        if self.tool_workers < 1:
            raise ValueError(f"CurationConfig.tool_workers must be >= 1, got {self.tool_workers}")
        if self.expert_tools not in ("exact", "environment"):
            raise ValueError(f"CurationConfig.expert_tools must be 'exact' or 'environment', got {self.expert_tools!r}")
        if not 0.0 <= self.rl_fraction <= 1.0:
            raise ValueError(f"CurationConfig.rl_fraction must lie in [0, 1], got {self.rl_fraction}")
        if self.rollouts_per_item < 1 or self.per_domain < 1:
            raise ValueError("CurationConfig.rollouts_per_item and per_domain must be >= 1")


def world_sampling(world: World) -> SamplingConfig:
    """The paper's rules with the world's scaled thresholds."""
    return SamplingConfig(hub_threshold=world.sampling.hub_threshold,
                          min_seed_in_degree=world.sampling.min_seed_in_degree,
                          min_image_side=world.sampling.min_image_side)


def sample_items(world: World, out: Path, config: CurationConfig, sampling: SamplingConfig) -> dict[str, Any]:
    """Stage 1: seeds -> rewritten QA items (path sampling with retries + fuzzy rewriting)."""
    graph = world.graph
    seeds = stratified_seeds(graph, sampling, config.per_domain, random.Random(config.seed))
    evaluator = ExactGraphEvaluator(graph)
    attempts_path = out / "candidates.attempts.json"  # failed attempts per seed, kept across resumes
    failures: dict[str, dict[str, int]] = (json.loads(attempts_path.read_text(encoding="utf-8"))
                                           if attempts_path.exists() else {})

    def build(seed: str) -> QAItem | Drop:
        rng = random.Random(stable_seed(config.seed, "sample", seed))  # per seed: resumable + order-free

        def accept(path: SampledPath) -> QAItem | Rejection:
            result = rewrite(graph, path, GraphDescriptorProposer(graph, rng), evaluator, rng, config.obfuscate_prob)
            if result.question is None:
                return Rejection("no_unique_descriptor")
            return QAItem(seed, list(path.nodes), list(path.relations), path.attribute, result.answer,
                          result.question, canonical=render_question(canonical_question(graph, path)),
                          rewrite_log=[asdict(e) for e in result.log])

        outcome = sample_with_retries(graph, seed, rng, sampling, accept)
        failures[seed] = dict(outcome.failures)
        attempts_path.write_text(json.dumps(failures, sort_keys=True), encoding="utf-8")
        return outcome.result if outcome.result is not None else Drop("retries_exhausted")  # type: ignore[return-value]

    counts = run_stage("sample", seeds, out / "candidates.jsonl", build, key=lambda s: s)
    counts["attempt_failures"] = dict(sum((Counter(f) for f in failures.values()), Counter()))
    return counts


def load_rgb(path: Path) -> np.ndarray:
    data = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if data is None:
        raise ValueError(f"cannot read image {path}")
    return cv2.cvtColor(data, cv2.COLOR_BGR2RGB)


def is_rl(item_id: str, config: CurationConfig) -> bool:
    return (stable_seed(config.seed, "split", item_id) % 1_000_000) / 1_000_000 < config.rl_fraction


def question_image(world: World, out: Path, item: QAItem) -> np.ndarray:
    if item.degradation is not None:
        return load_rgb(out / item.degradation["image"])
    if item.image is None:
        raise ValueError(f"item {item.id} has no image")
    return load_rgb(world.root / item.image)


def curate(world: World, out: str | Path, config: CurationConfig = CurationConfig(), *,
           closed_book: Solver | None = None, image_search: Solver | None = None,
           expert: Expert | None = None) -> dict[str, Any]:
    """Run (or resume) every stage; returns and writes ``curation.json`` with all counts.

    ``closed_book`` / ``image_search`` replace the exact stage-1 / stage-2 solvers (e.g. a chat
    model, the real ImageSearch tool) and ``expert`` the scripted expert (e.g. a chat model);
    each still goes through the stage's cache and budget."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    graph = world.graph
    sampling = world_sampling(world)
    by_page = images_by_page(world.images())
    counts: dict[str, Any] = {"sample": sample_items(world, out, config, sampling)}
    grounder = AnchorGrounder(graph, by_page, world.root, MetadataScorer(), config.min_grounding_score,
                              sampling.min_image_side)
    counts["ground"] = run_stage("ground", read_items(out / "candidates.jsonl"), out / "grounded.jsonl", grounder)
    closed = CachedSolver(closed_book or ClosedBookSolver(graph, config.fame_in_degree),
                          out / "cache" / "closed_book.jsonl", config.solver_budget)
    one_search = CachedSolver(image_search or ImageSearchSolver(graph, by_page, config.fame_in_degree),
                              out / "cache" / "image_search.jsonl", config.solver_budget)
    counts["no_tools"] = run_stage("no_tools", read_items(out / "grounded.jsonl"), out / "no_tools.jsonl",
                                   SolverFilter(closed, "answerable_without_tools"))
    counts["single_image_search"] = run_stage(
        "single_image_search", read_items(out / "no_tools.jsonl"), out / "one_image_search.jsonl",
        SolverFilter(one_search, "solvable_with_one_image_search"))
    kept_from = out / "one_image_search.jsonl"
    if config.text_search_filter:
        two_calls = CachedSolver(ImageSearchSolver(graph, by_page, config.fame_in_degree, text_search=True),
                                 out / "cache" / "image_plus_text_search.jsonl", config.solver_budget)
        counts["image_plus_text_search"] = run_stage(
            "image_plus_text_search", read_items(kept_from), out / "kept.jsonl",
            SolverFilter(two_calls, "solvable_with_image_search_plus_text_search"))
        kept_from = out / "kept.jsonl"
    degrader = Degrader(world.root, out, load_rgb, config.degrade_fraction, config.seed)
    counts["degrade"] = run_stage("degrade", read_items(kept_from), out / "items.jsonl", degrader)
    counts["synthesize"] = _split_and_synthesize(world, out, config, expert)
    (out / "curation.json").write_text(json.dumps(counts, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return counts


def _split_and_synthesize(world: World, out: Path, config: CurationConfig, expert: Expert | None) -> dict[str, Any]:
    """RL prompts for the RL share; expert trajectories (judged) for the rest. Idempotent: a
    finished split is not redone."""
    marker = out / "synthesis.json"
    if marker.exists():
        return json.loads(marker.read_text(encoding="utf-8"))
    for stale in (out / "sft" / "trajectories.jsonl", out / "rl" / "prompts.jsonl"):
        stale.unlink(missing_ok=True)
    real_tools = expert is None and config.expert_tools == "environment"
    environment = (world_environment(world, PoolConfig(num_workers=config.tool_workers),
                                     index_path=out / "cache" / "corpus.fts5.sqlite") if real_tools
                   else nullcontext(None))
    with environment as tools:
        if expert is None:
            expert = ScriptedExpert(world.graph, tools or WorldTools(world), config.expert)
        result = _synthesize_all(world, out, config, expert)
    marker.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return result


def _synthesize_all(world: World, out: Path, config: CurationConfig, expert: Expert) -> dict[str, Any]:
    report = SynthesisReport()
    sft_items = rl_items = 0
    for group, item in enumerate(read_items(out / "items.jsonl")):
        image = question_image(world, out, item)
        if is_rl(item.id, config):
            write_prompts(out / "rl" / "prompts.jsonl",
                          [Prompt(id=item.id, question=item.text, images=[image], answer=item.answer,
                                  aliases=item.aliases)])
            rl_items += 1
            continue
        sft_items += 1
        rng = random.Random(stable_seed(config.seed, "expert", item.id))
        trajectories = synthesize(item, image, expert, config.rollouts_per_item, rng, ExactMatchAccuracyJudge(),
                                  HeuristicQueryJudge(), config.min_process_score, report, group)
        append_jsonl(out / "sft" / "trajectories.jsonl", trajectories)
    (out / "sft").mkdir(parents=True, exist_ok=True)
    (out / "sft" / "trajectories.jsonl").touch()
    (out / "rl").mkdir(parents=True, exist_ok=True)
    (out / "rl" / "prompts.jsonl").touch()
    return {"sft_items": sft_items, "rl_items": rl_items, **asdict(report)}
