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
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.trajectory import Prompt, append_jsonl, write_prompts
from osvl.synth.environment import EnvironmentTools
from osvl.synth.expert import (
    Expert,
    ExpertConfig,
    ScriptedExpert,
    SynthesisReport,
    WorldTools,
    synthesize,
)
from osvl.synth.filtering import (
    BudgetExhausted,
    CachedSolver,
    ClosedBookSolver,
    ImageSearchSolver,
    Solver,
    SolverFilter,
    images_by_page,
)
from osvl.synth.grounding import AnchorGrounder, Degrader, MetadataScorer
from osvl.synth.llm_access import LLMUnavailable, LLMUsage
from osvl.synth.question import render_question
from osvl.synth.records import Drop, QAItem, read_items, run_stage
from osvl.synth.rewrite import (
    DescriptorProposer,
    ExactGraphEvaluator,
    GraphDescriptorProposer,
    UniquenessEvaluator,
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
from osvl.synth.tool_solvers import SolverUnavailable
from osvl.tools import PoolConfig
from osvl.tools.world import world_environment
from osvl.world.build import World
from osvl.world.render import stable_seed

ProposerFactory = Callable[[random.Random], DescriptorProposer]  # one proposer per seed, on its rng


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
    return SamplingConfig(
        hub_threshold=world.sampling.hub_threshold,
        min_seed_in_degree=world.sampling.min_seed_in_degree,
        min_image_side=world.sampling.min_image_side,
    )


def sample_items(
    world: World,
    out: Path,
    config: CurationConfig,
    sampling: SamplingConfig,
    proposer: ProposerFactory | None = None,
    evaluator: UniquenessEvaluator | None = None,
) -> dict[str, Any]:
    """Stage 1: seeds -> rewritten QA items (path sampling with retries + fuzzy rewriting); the
    graph proposer and the exact evaluator unless others are given."""
    graph = world.graph
    seeds = stratified_seeds(graph, sampling, config.per_domain, random.Random(config.seed))
    evaluator = evaluator or ExactGraphEvaluator(graph)
    proposer = proposer or (lambda rng: GraphDescriptorProposer(graph, rng))
    attempts_path = out / "candidates.attempts.json"  # failed attempts per seed, kept across resumes
    failures: dict[str, dict[str, int]] = (
        json.loads(attempts_path.read_text(encoding="utf-8")) if attempts_path.exists() else {}
    )

    def build(seed: str) -> QAItem | Drop:
        rng = random.Random(stable_seed(config.seed, "sample", seed))  # per seed: resumable + order-free

        def accept(path: SampledPath) -> QAItem | Rejection:
            result = rewrite(graph, path, proposer(rng), evaluator, rng, config.obfuscate_prob)
            if result.question is None:
                return Rejection("no_unique_descriptor")
            return QAItem(
                seed,
                list(path.nodes),
                list(path.relations),
                path.attribute,
                result.answer,
                result.question,
                canonical=render_question(canonical_question(graph, path)),
                rewrite_log=[asdict(e) for e in result.log],
            )

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


STAGE_NAMES = ("sample", "ground", "no_tools", "single_image_search", "image_plus_text_search", "degrade", "synthesize")


STOPS = (LLMUnavailable, SolverUnavailable, BudgetExhausted)  # a backend cannot decide now: stop, resume later


def curate(
    world: World,
    out: str | Path,
    config: CurationConfig = CurationConfig(),
    *,
    closed_book: Solver | None = None,
    image_search: Solver | None = None,
    expert: Expert | None = None,
    proposer: ProposerFactory | None = None,
    evaluator: UniquenessEvaluator | None = None,
    llm_usage: LLMUsage | None = None,
) -> dict[str, Any]:
    """Run (or resume) every stage; returns and writes ``curation.json`` with all counts.

    ``proposer`` / ``evaluator`` replace the graph rewriter and the exact uniqueness evaluator
    (e.g. an LLM), ``closed_book`` / ``image_search`` the exact stage-1 / stage-2 solvers (e.g. a
    chat model, the real ImageSearch tool) and ``expert`` the scripted expert (e.g. a chat model);
    each still goes through the stage's cache and budget. When a backend cannot decide an item
    (an outage, a spent budget) the run stops there: ``counts["stopped"]`` names the stage and the
    error, everything decided so far is on disk, and the next run resumes."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, Any] = {}
    try:
        _run_stages(world, out, config, counts, closed_book, image_search, expert, proposer, evaluator)
    except STOPS as error:
        stage = next(
            s for s in STAGE_NAMES if s not in counts and (config.text_search_filter or s != "image_plus_text_search")
        )
        counts["stopped"] = {"stage": stage, "error": f"{type(error).__name__}: {error}"}
    if llm_usage is not None:
        counts["llm"] = llm_usage.to_dict()
    (out / "curation.json").write_text(json.dumps(counts, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return counts


def _run_stages(
    world: World,
    out: Path,
    config: CurationConfig,
    counts: dict[str, Any],
    closed_book: Solver | None,
    image_search: Solver | None,
    expert: Expert | None,
    proposer: ProposerFactory | None,
    evaluator: UniquenessEvaluator | None,
) -> None:
    graph = world.graph
    sampling = world_sampling(world)
    by_page = images_by_page(world.images())
    counts["sample"] = sample_items(world, out, config, sampling, proposer, evaluator)
    grounder = AnchorGrounder(
        graph, by_page, world.root, MetadataScorer(), config.min_grounding_score, sampling.min_image_side
    )
    counts["ground"] = run_stage("ground", read_items(out / "candidates.jsonl"), out / "grounded.jsonl", grounder)
    closed = CachedSolver(
        closed_book or ClosedBookSolver(graph, config.fame_in_degree),
        out / "cache" / "closed_book.jsonl",
        config.solver_budget,
    )
    one_search = CachedSolver(
        image_search or ImageSearchSolver(graph, by_page, config.fame_in_degree),
        out / "cache" / "image_search.jsonl",
        config.solver_budget,
    )
    counts["no_tools"] = run_stage(
        "no_tools",
        read_items(out / "grounded.jsonl"),
        out / "no_tools.jsonl",
        SolverFilter(closed, "answerable_without_tools"),
    )
    counts["single_image_search"] = run_stage(
        "single_image_search",
        read_items(out / "no_tools.jsonl"),
        out / "one_image_search.jsonl",
        SolverFilter(one_search, "solvable_with_one_image_search"),
    )
    kept_from = out / "one_image_search.jsonl"
    if config.text_search_filter:
        two_calls = CachedSolver(
            ImageSearchSolver(graph, by_page, config.fame_in_degree, text_search=True),
            out / "cache" / "image_plus_text_search.jsonl",
            config.solver_budget,
        )
        counts["image_plus_text_search"] = run_stage(
            "image_plus_text_search",
            read_items(kept_from),
            out / "kept.jsonl",
            SolverFilter(two_calls, "solvable_with_image_search_plus_text_search"),
        )
        kept_from = out / "kept.jsonl"
    degrader = Degrader(world.root, out, load_rgb, config.degrade_fraction, config.seed)
    counts["degrade"] = run_stage("degrade", read_items(kept_from), out / "items.jsonl", degrader)
    counts["synthesize"] = _split_and_synthesize(world, out, config, expert)


def _split_and_synthesize(world: World, out: Path, config: CurationConfig, expert: Expert | None) -> dict[str, Any]:
    """RL prompts for the RL share; expert trajectories (judged) for the rest. Resumable per item
    (``synthesis.progress.jsonl`` while under way); a finished split is not redone."""
    marker = out / "synthesis.json"
    if marker.exists():
        return json.loads(marker.read_text(encoding="utf-8"))
    real_tools = expert is None and config.expert_tools == "environment"
    environment = (
        world_environment(
            world, PoolConfig(num_workers=config.tool_workers), index_path=out / "cache" / "corpus.fts5.sqlite"
        )
        if real_tools
        else nullcontext(None)
    )
    with environment as env:
        if expert is None:
            tools = EnvironmentTools(env) if env is not None else WorldTools(world)
            expert = ScriptedExpert(world.graph, tools, config.expert)
        result = _synthesize_all(world, out, config, expert)
    marker.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / SYNTHESIS_PROGRESS).unlink()
    return result


SYNTHESIS_PROGRESS = "synthesis.progress.jsonl"
_SPLIT_FILES = (
    ("sft/trajectories.jsonl", lambda row: row["prompt"]["id"]),
    ("rl/prompts.jsonl", lambda row: row["id"]),
)


def _resume_synthesis(out: Path) -> dict[str, dict[str, Any]]:
    """Items already synthesized (id -> progress row); lines of undecided items are removed
    from the split files, so an interrupted item is redone without duplicates."""
    progress = out / SYNTHESIS_PROGRESS
    done: dict[str, dict[str, Any]] = {}
    if progress.exists():
        with open(progress, encoding="utf-8") as handle:
            done = {row["id"]: row for row in map(json.loads, filter(str.strip, handle))}
    for name, item_id in _SPLIT_FILES:
        path = out / name
        if not path.exists():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and item_id(json.loads(line)) in done]
        if len(kept) != len(lines):
            path.write_text("".join(kept), encoding="utf-8")
    progress.touch()
    return done


def _synthesize_all(world: World, out: Path, config: CurationConfig, expert: Expert) -> dict[str, Any]:
    done = _resume_synthesis(out)
    totals = Counter({"sft_items": 0, "rl_items": 0, **asdict(SynthesisReport())})
    for row in done.values():
        totals.update(row["counts"])
    for group, item in enumerate(read_items(out / "items.jsonl")):
        if item.id in done:
            continue
        image = question_image(world, out, item)
        if is_rl(item.id, config):
            write_prompts(
                out / "rl" / "prompts.jsonl",
                [Prompt(id=item.id, question=item.text, images=[image], answer=item.answer, aliases=item.aliases)],
            )
            item_counts = {"rl_items": 1}
        else:
            report = SynthesisReport()
            rng = random.Random(stable_seed(config.seed, "expert", item.id))
            trajectories = synthesize(
                item,
                image,
                expert,
                config.rollouts_per_item,
                rng,
                ExactMatchAccuracyJudge(),
                HeuristicQueryJudge(),
                config.min_process_score,
                report,
                group,
            )
            append_jsonl(out / "sft" / "trajectories.jsonl", trajectories)
            item_counts = {"sft_items": 1, **asdict(report)}
        totals.update(item_counts)
        with open(out / SYNTHESIS_PROGRESS, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"id": item.id, "counts": item_counts}) + "\n")
    (out / "sft").mkdir(parents=True, exist_ok=True)
    (out / "sft" / "trajectories.jsonl").touch()
    (out / "rl").mkdir(parents=True, exist_ok=True)
    (out / "rl" / "prompts.jsonl").touch()
    return {
        "sft_items": totals["sft_items"],
        "rl_items": totals["rl_items"],
        **{name: totals[name] for name in asdict(SynthesisReport())},
    }
