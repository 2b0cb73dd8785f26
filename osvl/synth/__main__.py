"""``python -m osvl.synth run|stats --world DIR --out DIR``: curate the mini-world, then report."""

from __future__ import annotations

import argparse
import json

from osvl.synth.pipeline import CurationConfig, curate
from osvl.synth.stats import curation_stats, format_stats
from osvl.world.build import load_world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.synth")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run (or resume) every curation stage"),
                            ("stats", "statistics of a curated set, checked against the world")):
        command = sub.add_parser(name, help=help_text)
        command.add_argument("--world", required=True)
        command.add_argument("--out", required=True)
        command.add_argument("--seed", type=int, default=0)
    sub.choices["run"].add_argument(
        "--expert-tools", choices=("exact", "environment"), default="exact",
        help="the scripted expert's tools: exact in-process stand-ins, or the real tool pool over the world")
    args = parser.parse_args(argv)
    world = load_world(args.world)
    config = CurationConfig(seed=args.seed, expert_tools=getattr(args, "expert_tools", "exact"))
    if args.command == "run":
        print(json.dumps(curate(world, args.out, config), indent=2, sort_keys=True))
    else:
        print(format_stats(curation_stats(world, args.out, config.fame_in_degree)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
