"""``python -m osvl.world build --out DIR --seed 0 [--scale N]``: generate the mini-world."""

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
    build.add_argument("--scale", type=int, default=1, help="multiply the entity counts (the demo uses more data)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        config = WorldConfig(seed=args.seed).scaled(args.scale)
    except ValueError as error:
        parser.error(str(error))
    manifest = build_world(args.out, config)
    print(json.dumps({"out": args.out, "seconds": round(time.perf_counter() - start, 2), **manifest["counts"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
