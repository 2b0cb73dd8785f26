"""``python -m osvl.synth run|stats|drills|reading``: curate a world (or a converted Wikipedia graph),
report, write lookup drills (``osvl.synth.drills``) for a policy trained from scratch, and write the
reading-comprehension text (``osvl.synth.reading``) a small base model is pretrained on.

``run`` takes a TOML config (``--config``, reference in ``osvl/synth/README.md``) and flags for
the common cases; a flag overrides the file's key. Exit status 3: a back-end stopped the run
(outage, spent budget); everything decided is on disk and the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from osvl.jsonl import write_jsonl
from osvl.rl.trajectory import append_jsonl, write_prompts
from osvl.synth.backends import open_backends
from osvl.synth.drills import held_out_prompts, lookup_drills, name_drills, split_anchors
from osvl.synth.pipeline import CurationConfig, curate, is_rl
from osvl.synth.reading import ReadingConfig, ReadingSource, reading_corpus
from osvl.synth.records import read_items
from osvl.synth.run_config import build_run_config, read_toml, set_key
from osvl.synth.stats import curation_stats, format_stats
from osvl.world.build import load_world

STOPPED = 3
LLM_STAGE_KEYS = {
    "rewrite": ("stages.rewrite",),
    "uniqueness": ("stages.uniqueness",),
    "filter": ("stages.closed_book", "stages.image_search"),
    "expert": ("stages.expert",),
}
# flag destination -> config key
FLAG_KEYS = {
    "world": "source.world",
    "graph": "source.graph",
    "images": "source.images",
    "corpus": "source.corpus",
    "seed": "curation.seed",
    "rollouts": "curation.rollouts_per_item",
    "per_domain": "curation.per_domain",
    "expert_tools": "tools.mode",
    "tool_workers": "tools.workers",
    "text_search": "tools.text_search",
    "filter_image_search": "stages.image_search",
    "llm_url": "llm.url",
    "llm_model": "llm.model",
    "llm_api_key_env": "llm.api_key_env",
    "max_llm_calls": "budget.max_llm_calls",
    "llm_cache_dir": "budget.cache_dir",
}


def _run_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run (or resume) every curation stage")
    run.add_argument("--config", help="TOML run config (flags override its keys)")
    run.add_argument("--out", required=True)
    run.add_argument("--world", help="a world directory (python -m osvl.world build)")
    run.add_argument("--graph", help="a graph JSONL (osvl.world.wikipedia converter output) instead of --world")
    run.add_argument("--images", help="with --graph: the directory its image files are relative to")
    run.add_argument("--corpus", help="with --graph: corpus.jsonl (default: beside the graph)")
    run.add_argument("--seed", type=int)
    run.add_argument("--rollouts", type=int, help="expert rollouts per SFT item")
    run.add_argument("--per-domain", type=int, help="seeds per domain")
    run.add_argument("--expert-search-top-k", type=int, help="passages the scripted expert asks each text_search for")
    run.add_argument(
        "--expert-tools",
        choices=("exact", "environment"),
        help="the expert's tools: exact in-process stand-ins, or the real tool pool",
    )
    run.add_argument("--tool-workers", type=int)
    run.add_argument("--text-search", choices=("offline", "online"), help="the tool pool's TextSearch back-end")
    run.add_argument("--image-search-url", help="an online reverse-image API for the tool pool's ImageSearch")
    run.add_argument(
        "--filter-image-search",
        choices=("exact", "tools", "llm"),
        help="filter stage 2: exact solver, one real ImageSearch call, or the LLM given that call's result",
    )
    run.add_argument("--llm-url", help="OpenAI-compatible base URL ending in /v1")
    run.add_argument("--llm-model")
    run.add_argument("--llm-api-key-env", help="name of the environment variable holding the API key")
    run.add_argument("--llm-stages", help=f"comma-separated stages that use the LLM: {', '.join(LLM_STAGE_KEYS)}")
    run.add_argument("--max-llm-calls", type=int, help="LLM call budget of this run (0: unlimited)")
    run.add_argument("--llm-cache-dir", help="reply cache of the deterministic LLM stages")


def raw_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config file's tree with the flags written in."""
    raw = read_toml(args.config) if args.config else {}
    if args.graph and "source" in raw:
        raw["source"].pop("world", None)  # --graph replaces the file's source
    if args.world and "source" in raw:
        for key in ("graph", "images", "corpus"):
            raw["source"].pop(key, None)
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest)
        if value is not None:
            set_key(raw, key, value)
    if args.expert_search_top_k is not None:
        curation = raw.setdefault("curation", {})
        curation.setdefault("expert", {})["search_top_k"] = args.expert_search_top_k
    if args.image_search_url is not None:
        set_key(raw, "tools.image_search", "online")
        set_key(raw, "tools.image_search_url", args.image_search_url)
    if args.llm_stages is not None:
        for name in filter(None, (s.strip() for s in args.llm_stages.split(","))):
            if name not in LLM_STAGE_KEYS:
                raise ValueError(f"--llm-stages: unknown stage {name!r}; known: {', '.join(LLM_STAGE_KEYS)}")
            for key in LLM_STAGE_KEYS[name]:
                set_key(raw, key, "llm")
    return raw


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with ExitStack() as stack:
        try:  # configuration errors stop here, before any stage runs
            config = build_run_config(raw_config(args))
            backends = stack.enter_context(open_backends(config, args.out))
        except ValueError as error:
            parser.error(str(error))
        counts = curate(backends.world, args.out, config.curation, **backends.curate_kwargs)
    print(json.dumps(counts, indent=2, sort_keys=True))
    if "stopped" in counts:
        print(
            f"stopped in stage {counts['stopped']['stage']}: {counts['stopped']['error']}; "
            f"rerun the same command to resume",
            file=sys.stderr,
        )
        return STOPPED
    return 0


def _shares(text: str, parser: argparse.ArgumentParser) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"--hop-shares takes comma-separated numbers (e.g. 0.75,0.25), got {text!r}")


def write_drills(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    rl_nodes: set[str] = set()
    anchors: set[str] = set()
    if args.data is not None:
        data = Path(args.data)
        if not (data / "items.jsonl").is_file():
            parser.error(f"--data {data} has no items.jsonl: run `python -m osvl.synth run` first")
        config = CurationConfig(seed=args.curation_seed)  # the RL split of the curated set, not the drills' draw
        rl_items = [item for item in read_items(data / "items.jsonl") if is_rl(item.id, config)]
        rl_nodes = {node for item in rl_items for node in item.path}
        anchors = {item.path[0] for item in rl_items}
    elif args.held_out_prompts:
        parser.error("--held-out-prompts needs --data: its questions start at the curated RL items' entities")
    if args.anchors != "all" and not args.held_out_prompts:
        parser.error("--anchors splits the anchors of --held-out-prompts")
    if args.names and args.held_out_prompts:
        parser.error("--names writes SFT drills; it does not combine with --held-out-prompts")
    if args.hop_shares is not None and args.names:
        parser.error("--hop-shares shapes lookup drills and held-out prompts; it does not combine with --names")
    for flag, given in (
        ("--tool-faults", bool(args.tool_faults)),
        ("--recall", bool(args.recall)),
    ):
        if given and (args.names or args.held_out_prompts):
            parser.error(f"{flag} shapes lookup drills; it does not combine with --names or --held-out-prompts")
    hop_shares = _shares(args.hop_shares, parser) if args.hop_shares is not None else None
    max_hops = args.max_hops if args.max_hops is not None else len(hop_shares) if hop_shares else 2
    try:
        if args.anchors != "all":
            train, held = split_anchors(anchors, args.eval_anchor_fraction)
            if args.anchors.startswith("train-"):  # pilots: GRPO on one half of the training side, validate on the rest
                fit, val = split_anchors(train, 0.5, seed=1)
                train = fit if args.anchors == "train-fit" else val
            anchors = set(held if args.anchors == "eval" else train)
        world = load_world(args.world)
        if args.names:
            drills = name_drills(world, args.count, args.seed)
        elif args.held_out_prompts:
            prompts = held_out_prompts(
                world,
                anchors,
                args.count,
                args.seed,
                args.search_top_k,
                max_hops=max_hops,
                max_guess_rate=args.max_guess_rate,
                hop_shares=hop_shares,
            )
        else:
            drills = lookup_drills(
                world,
                args.count,
                args.seed,
                rl_nodes,
                args.search_top_k,
                max_hops=max_hops,
                max_guess_rate=args.max_guess_rate,
                caption_link_fraction=args.caption_links,
                hop_shares=hop_shares,
                tool_fault_rate=args.tool_faults,
                recall_fraction=args.recall,
            )
    except ValueError as error:
        parser.error(str(error))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).unlink(missing_ok=True)  # only now: a failed run leaves the previous file as it was
    if args.held_out_prompts:
        write_prompts(args.out, prompts)
        print(
            json.dumps({"prompts": len(prompts), "rl_anchors": len(anchors), "anchors": args.anchors, "out": args.out})
        )
        return 0
    append_jsonl(args.out, drills)
    print(json.dumps({"drills": len(drills), "excluded_rl_entities": len(rl_nodes), "out": args.out}))
    return 0


def write_reading(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    try:
        config = ReadingConfig(copy_fraction=args.copy_fraction)
        sources = [ReadingSource.from_world(load_world(world)) for world in args.world]
    except ValueError as error:
        parser.error(str(error))
    write_jsonl(args.out, ({"text": text} for text in reading_corpus(sources, args.count, args.seed, config)))
    print(json.dumps({"documents": args.count, "worlds": args.world, "out": args.out}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.synth")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    stats = sub.add_parser("stats", help="statistics of a curated set, checked against the world")
    stats.add_argument("--world", required=True)
    stats.add_argument("--out", required=True)
    stats.add_argument("--seed", type=int, default=0)
    drills = sub.add_parser("drills", help="text-only lookup chains for a policy trained from scratch (the demo)")
    drills.add_argument("--world", required=True)
    drills.add_argument(
        "--data",
        help="a curated set of this world: the entities of its RL items are left out (omit for a world other "
        "than the agent's, whose every entity may be drilled)",
    )
    drills.add_argument("--count", type=int, required=True)
    drills.add_argument(
        "--out", required=True, help="JSONL of SFT trajectory records (RL prompts with --held-out-prompts)"
    )
    drills.add_argument(
        "--held-out-prompts",
        action="store_true",
        help="write short visual RL prompts that start at the RL items' image entities instead",
    )
    drills.add_argument(
        "--names",
        action="store_true",
        help="write name drills instead: lists of the world's entity names to repeat (every name a target, no "
        "facts), for a tokenizer with one id per name",
    )
    drills.add_argument(
        "--anchors",
        choices=("all", "train", "eval", "train-fit", "train-val"),
        default="all",
        help="with --held-out-prompts: start at every RL anchor, or only at the training or the evaluation side "
        "of their fixed split (questions on the two sides share no starting entity); train-fit and train-val cut "
        "the training side in two more (for pilots: train on one, validate on entities neither it nor the "
        "evaluation starts at)",
    )
    drills.add_argument(
        "--eval-anchor-fraction", type=float, default=0.5, help="share of the RL anchors on the evaluation side"
    )
    drills.add_argument("--seed", type=int, default=0, help="seed of the drills' draw")
    drills.add_argument(
        "--curation-seed", type=int, default=0, help="the seed `osvl.synth run` curated --data with (its RL split)"
    )
    drills.add_argument("--search-top-k", type=int, default=1)
    drills.add_argument(
        "--max-hops",
        type=int,
        help="relation hops before the attribute lookup: each drill or question draws 1..this many (default 2, "
        "or the number of --hop-shares)",
    )
    drills.add_argument(
        "--hop-shares",
        help="lookup drills only: the exact share of drills with 1, 2, ... hops, comma-separated (0.75,0.25: "
        "a quarter of 2-hop drills); without it each drill draws its hop count uniformly, and the longer "
        "chains, rejected more often, end up fewer",
    )
    drills.add_argument(
        "--max-guess-rate",
        type=float,
        default=1.0,
        help="never ask an attribute whose most common value (for that kind of entity) a blind guess "
        "would get right more often than this",
    )
    drills.add_argument(
        "--caption-links",
        type=float,
        default=0.0,
        help="share of the visual lookup drills whose image caption states a true link drawn for that drill, so "
        "the linked name varies and only the match's title is the one to search",
    )
    drills.add_argument(
        "--tool-faults",
        type=float,
        default=0.0,
        help="lookup drills only: share of tool calls that fail first as GRPO's injected faults do "
        "('Error (tool_error): injected fault'), the expert making the same call again",
    )
    drills.add_argument(
        "--recall",
        type=float,
        default=0.0,
        help="lookup drills only: share of the longest (--max-hops) drills the expert answers from its own "
        "knowledge, without looking the asked value up (a guess for a policy that never saw the entity)",
    )
    reading = sub.add_parser("reading", help="plain-text reading comprehension over worlds (base pretraining)")
    reading.add_argument("--world", required=True, action="append", help="a world directory (repeatable)")
    reading.add_argument("--count", type=int, required=True, help="documents to write")
    reading.add_argument("--out", required=True, help='JSONL of {"text": ...} records')
    reading.add_argument("--seed", type=int, default=0)
    reading.add_argument(
        "--copy-fraction",
        type=float,
        default=ReadingConfig.copy_fraction,
        help="share of documents that list names and numbers and repeat the list",
    )
    args = parser.parse_args(argv)
    if args.command == "reading":
        return write_reading(args, parser)
    if args.command == "drills":
        return write_drills(args, parser)
    if args.command == "stats":
        world = load_world(args.world)
        print(format_stats(curation_stats(world, args.out, CurationConfig(seed=args.seed).fame_in_degree)))
        return 0
    return run(args, parser)


if __name__ == "__main__":
    raise SystemExit(main())
