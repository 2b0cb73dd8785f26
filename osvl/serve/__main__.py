"""``python -m osvl.serve --recipe NAME --nodes N``: the service side of a GRPO recipe.

Prints, per node, the commands that start the inference servers (SGLang, with an optional
sglang-router, or vLLM with ``--engine vllm``), the tool server, and the trainer's ``torchrun`` with
the ``--set`` overrides that point it at them; which flags come from the recipe, and why, is in
:mod:`osvl.serve.commands`. ``--engine loopback --launch`` starts the CPU form on this machine instead
(:mod:`osvl.serve.loopback_services`) and keeps it up until interrupted: a service that dies is
started again on its port, the others untouched (:mod:`osvl.serve.supervisor`; ``--max-restarts``
within ``--restart-window-s``, then all stop).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import threading
from pathlib import Path

from osvl.config import load_recipe
from osvl.serve.commands import Layout, plan_commands
from osvl.serve.loopback_services import loopback_overrides, loopback_services
from osvl.serve.supervisor import RestartPolicy, Supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="a GRPO recipe name in osvl/recipes/ or a .toml path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--train-gpus", type=int, default=4, help="trainer GPUs per node; the rest serve")
    parser.add_argument("--hosts", default="", help="comma-separated node host names (default node0,node1,...)")
    parser.add_argument("--router", action="store_true", help="put an sglang-router in front of the servers")
    parser.add_argument(
        "--engine",
        choices=("sglang", "vllm", "loopback"),
        default=None,
        help="the inference servers to plan (default: the recipe's rollout.engine, else sglang)",
    )
    parser.add_argument("--launch", action="store_true", help="start the services here (loopback engine only)")
    parser.add_argument(
        "--any-ports",
        action="store_true",
        help="with --launch: free ports instead of the recipe's (the printed --set overrides point there)",
    )
    defaults = RestartPolicy()
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        help="with --launch: restarts of one service within --restart-window-s before every service stops",
    )
    parser.add_argument(
        "--restart-window-s",
        type=float,
        default=defaults.window_s,
        help="with --launch: the window in which --max-restarts deaths of one service mean it keeps dying",
    )
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    if recipe.job.stage != "grpo":
        parser.error(f"recipe {recipe.job.name} is a {recipe.job.stage} recipe; serving is for GRPO")
    engine = args.engine or (recipe.rollout.engine if recipe.rollout.engine in ("sglang", "vllm") else "sglang")
    if engine == "loopback":
        if not args.launch:
            parser.error("--engine loopback starts the CPU form on this machine: add --launch")
        with tempfile.TemporaryDirectory(prefix="osvl-serve-") as directory:
            try:
                policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
                supervisor = Supervisor(loopback_services(recipe, args.any_ports), Path(directory), policy)
                urls = supervisor.start()
            except (ValueError, RuntimeError) as error:
                parser.error(str(error))
            stop = threading.Event()
            for number in (signal.SIGTERM, signal.SIGINT):
                signal.signal(number, lambda *_: stop.set())
            sets = " ".join(f"--set {shlex.quote(o)}" for o in [*args.overrides, *loopback_overrides(recipe, urls)])
            print(
                f"services up; train with:\n  torchrun --standalone --nproc_per_node 2 -m osvl.train "
                f"--recipe {args.recipe} {sets}",
                flush=True,
            )
            return supervisor.run(stop)
    if args.launch:
        parser.error("--launch starts the loopback (CPU) form only; run the printed commands on the cluster")
    hosts = tuple(h for h in args.hosts.split(",") if h) or tuple(f"node{i}" for i in range(args.nodes))
    if len(hosts) != args.nodes:
        parser.error(f"--hosts names {len(hosts)} hosts for --nodes {args.nodes}")
    layout = Layout(args.nodes, args.gpus_per_node, args.train_gpus, hosts, args.router)
    try:
        commands = plan_commands(recipe, layout, args.recipe, engine)
    except ValueError as error:
        parser.error(str(error))
    for command in commands:
        print(f"# {command.host}: {command.what}\n{command.shell()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
