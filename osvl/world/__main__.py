"""``python -m osvl.world build --out DIR --seed 0``: generate the mini-world."""

from __future__ import annotations

import argparse
import json
import time

from osvl.world.build import build_world
from osvl.world.generate import WorldConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.world")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="generate a world directory")
    build.add_argument("--out", required=True)
    build.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    manifest = build_world(args.out, WorldConfig(seed=args.seed))
    print(json.dumps({"out": args.out, "seconds": round(time.perf_counter() - start, 2), **manifest["counts"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
