"""Statistics of a curated set, verified against the world rather than trusted from the run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from osvl.rl.trajectory import read_jsonl, read_prompts
from osvl.synth.filtering import ImageSearchSolver, images_by_page, solved
from osvl.synth.question import GraphFacts, Resolver, leaked_forms, name_index
from osvl.synth.records import QAItem, read_counts, read_items
from osvl.world.build import World


def leaks(world: World, item: QAItem) -> list[str]:
    """Names or aliases of any path node (anchor included) that appear in the final question."""
    return leaked_forms(item.text, [f for node in item.path for f in world.graph.surface_forms(node)])


def is_unique(resolver: Resolver, item: QAItem) -> bool:
    """With the image identifying v0, every mention denotes exactly its node and the answer is one."""
    return all(resolver.resolve(item.question, i) == {node} for i, node in enumerate(item.path)) and resolver.answers(
        item.question
    ) == {item.answer}


def curation_stats(world: World, out: str | Path, fame_in_degree: int = 6) -> dict[str, Any]:
    out = Path(out)
    items = list(read_items(out / "items.jsonl"))
    if not items:
        raise ValueError(f"{out / 'items.jsonl'} holds no items; run `python -m osvl.synth run` first")
    names = name_index(world.graph)
    unique = sum(is_unique(Resolver(GraphFacts(world.graph), image_entity=i.path[0], names=names), i) for i in items)
    shortcut = ImageSearchSolver(world.graph, images_by_page(world.images()), fame_in_degree, text_search=True)
    rl_ids = {p.id for p in read_prompts(out / "rl" / "prompts.jsonl")}
    sft = list(read_jsonl(out / "sft" / "trajectories.jsonl"))
    sft_ids = {t.prompt.id for t in sft}
    calls = [sum(s.tool_call is not None for s in t.steps) for t in sft]
    filters = {}
    for name in ("candidates", "grounded", "no_tools", "one_image_search", "kept", "items"):
        counts = read_counts(out / f"{name}.jsonl")
        filters[name] = {"in": counts.get("in", 0), "kept": counts.get("kept", 0), "dropped": counts.get("dropped", {})}
    candidates = Counter(i.hops for i in read_items(out / "candidates.jsonl"))
    return {
        "items": len(items),
        "candidate_hops": dict(sorted(candidates.items())),
        "hops": dict(sorted(Counter(i.hops for i in items).items())),
        "leak_rate": sum(bool(leaks(world, i)) for i in items) / len(items),
        "uniqueness_rate": unique / len(items),
        "answerable_with_image_search_plus_text_search": sum(solved(shortcut.solve(i), i) for i in items),
        "degraded": dict(Counter(i.degradation["kind"] for i in items if i.degradation)),
        "obfuscated": sum(i.question.obfuscation is not None for i in items),
        "filters": filters,
        "rl_items": len(rl_ids),
        "sft_items": len(sft_ids),
        "sft_trajectories": len(sft),
        "sft_mean_tool_calls": round(sum(calls) / len(calls), 3) if calls else 0.0,
        "rl_sft_overlap": len(rl_ids & sft_ids),
    }


def format_stats(stats: dict[str, Any]) -> str:
    return json.dumps(stats, indent=2, sort_keys=True)
