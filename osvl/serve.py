"""``python -m osvl.serve --recipe NAME --nodes N``: the service side of a GRPO recipe.

Prints, per node, the commands that start the inference servers (SGLang, with an optional
sglang-router, or vLLM with ``--engine vllm``), the tool server, and the trainer's ``torchrun``
with the ``--set`` overrides that point it at them. Every flag that must agree with the trainer
comes from the recipe: the checkpoint the servers load (``model.pretrained``), the image
processor's pixel budget (its ``preprocessor_config.json``, also passed as SGLang's
``--mm-process-config`` / vLLM's ``--mm-processor-kwargs``), the context length
(``grpo.max_prompt_tokens + max_response_tokens``), the servers' TP size and memory fraction, and
the weight-update route. vLLM servers also get what osvl's client needs: the RL and RPC routes
(``VLLM_SERVER_DEV_MODE=1``), the token-in/token-out route (``--enable-scale-out``), logprobs
after temperature (``--logprobs-mode processed_logprobs``), request sampling without the
checkpoint's defaults (``--generation-config vllm``), and NCCL weight transfer for
``rollout.weight_sync = "distributed"``.

Layout: on every node the first ``--train-gpus`` GPUs run trainer ranks and the others run
SGLang servers of ``rollout.server_tp`` GPUs each. ``--engine loopback --launch`` starts the CPU
form on this machine instead (osvl's SGLang-protocol loopback server over the checkpoint, a
loopback judge when the recipe's judges are LLMs, and a tool server over the offline world) and
keeps them up until interrupted: a service that dies is started again on its port, the others
untouched (:mod:`osvl.supervisor`; ``--max-restarts`` within ``--restart-window-s``, then all stop).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from osvl.config import Recipe, load_recipe
from osvl.data.image import ImageConfig
from osvl.supervisor import RestartPolicy, ServiceSpec, Supervisor

TRAIN_PORT = 29400  # torchrun's c10d rendezvous
SGLANG_PORT = 30000
VLLM_PORT = 8200
ROUTER_PORT = 29000
TOOL_PORT = 8100
JUDGE_PORT = 8000


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    train_gpus: int  # per node
    hosts: tuple[str, ...]
    router: bool

    @property
    def serve_gpus(self) -> int:
        return self.gpus_per_node - self.train_gpus


@dataclass(frozen=True)
class Command:
    host: str
    what: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def server_image_config(recipe: Recipe) -> ImageConfig | None:
    """The processor settings the trainer will use, when the checkpoint ships them."""
    from osvl.data.formats import checkpoint_image_config

    if not recipe.model.pretrained or not Path(recipe.model.pretrained).is_dir():
        return None
    return checkpoint_image_config(recipe.model.pretrained)


def vllm_server_argv(recipe: Recipe, model: str, port: int, host: str = "0.0.0.0") -> list[str]:
    """``vllm serve`` with every flag osvl's vLLM client and the trainer's contract need."""
    r, g = recipe.rollout, recipe.grpo
    argv = [
        "vllm",
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(r.server_tp),
        "--gpu-memory-utilization",
        str(r.server_mem_fraction),
        "--max-model-len",
        str(g.max_prompt_tokens + g.max_response_tokens),
        "--dtype",
        recipe.parallel.param_dtype,
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",
        "--generation-config",
        "vllm",
    ]
    if r.weight_sync == "distributed":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    image = server_image_config(recipe)
    if image is not None:
        argv += [
            "--mm-processor-kwargs",
            json.dumps({"size": {"shortest_edge": image.min_pixels, "longest_edge": image.max_pixels}}),
        ]
    return argv


def plan_commands(recipe: Recipe, layout: Layout, recipe_arg: str, engine: str = "sglang") -> list[Command]:
    """Every command of the layout, in start order (servers, router, tool servers, trainer)."""
    r, g = recipe.rollout, recipe.grpo
    if layout.serve_gpus % r.server_tp:
        raise ValueError(
            f"{layout.serve_gpus} serving GPUs per node are not a multiple of rollout.server_tp {r.server_tp}"
        )
    if layout.train_gpus < 1 or layout.serve_gpus < r.server_tp:
        raise ValueError("each node needs at least one trainer GPU and rollout.server_tp serving GPUs")
    model = recipe.model.pretrained or "<HF checkpoint directory>"
    commands, workers, tools = [], [], []
    image = server_image_config(recipe)
    if engine == "vllm" and layout.router:
        raise ValueError("--router fronts SGLang servers; the trainer spreads requests over vLLM servers itself")
    for host in layout.hosts:
        for k in range(layout.serve_gpus // r.server_tp):
            first = layout.train_gpus + k * r.server_tp
            visible = ",".join(str(i) for i in range(first, first + r.server_tp))
            if engine == "vllm":
                port = VLLM_PORT + k
                commands.append(
                    Command(
                        host,
                        f"vLLM server {k} (GPUs {visible})",
                        tuple(vllm_server_argv(recipe, model, port)),
                        (("VLLM_SERVER_DEV_MODE", "1"), ("CUDA_VISIBLE_DEVICES", visible)),
                    )
                )
                workers.append(f"http://{host}:{port}")
                continue
            port = SGLANG_PORT + k
            argv = [
                "python",
                "-m",
                "sglang.launch_server",
                "--model-path",
                model,
                "--host",
                "0.0.0.0",
                "--port",
                str(port),
                "--tp-size",
                str(r.server_tp),
                "--mem-fraction-static",
                str(r.server_mem_fraction),
                "--context-length",
                str(g.max_prompt_tokens + g.max_response_tokens),
                "--dtype",
                recipe.parallel.param_dtype,
            ]
            if image is not None:
                argv += [
                    "--mm-process-config",
                    json.dumps({"image": {"min_pixels": image.min_pixels, "max_pixels": image.max_pixels}}),
                ]
            commands.append(
                Command(host, f"SGLang server {k} (GPUs {visible})", tuple(argv), (("CUDA_VISIBLE_DEVICES", visible),))
            )
            workers.append(f"http://{host}:{port}")
        tool_argv = [
            "python",
            "-m",
            "osvl.tools.server",
            "--tools",
            "recipes/tools/online.toml",
            "--host",
            "0.0.0.0",
            "--port",
            str(TOOL_PORT),
            "--workers",
            "16",
        ]
        if recipe.tools.python_interpreter:
            tool_argv += ["--python-interpreter", "--python-sandbox", recipe.tools.python_sandbox]
            if recipe.tools.sandbox_fusion_url:
                tool_argv += ["--sandbox-fusion-url", recipe.tools.sandbox_fusion_url]
        commands.append(Command(host, "tool server", tuple(tool_argv)))
        tools.append(f"http://{host}:{TOOL_PORT}")
    generate = workers
    if layout.router:
        commands.append(
            Command(
                layout.hosts[0],
                "sglang-router over every server",
                (
                    "python",
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "0.0.0.0",
                    "--port",
                    str(ROUTER_PORT),
                    "--worker-urls",
                    *workers,
                ),
            )
        )
        generate = [f"http://{layout.hosts[0]}:{ROUTER_PORT}"]
    world = layout.nodes * layout.train_gpus
    if engine == "vllm":
        served = ["rollout.engine=vllm", f"rollout.vllm_urls={json.dumps(workers)}"]
    else:
        served = [
            "rollout.engine=sglang",
            f"rollout.sglang_urls={json.dumps(generate)}",
            f"rollout.sglang_update_urls={json.dumps(workers)}",
        ]
    overrides = [f"job.world_size={world}", *served, f"tools.servers={json.dumps(tools)}"]
    dp_shard = world // (recipe.parallel.tp * recipe.parallel.dp_replicate)
    if recipe.parallel.dp_shard != -1 and recipe.parallel.dp_shard != dp_shard:
        overrides.append(f"parallel.dp_shard={dp_shard}")
    if r.weight_sync == "distributed" and engine == "sglang":
        overrides.append(f"rollout.weight_sync_master_addr={layout.hosts[0]}")
    for node, host in enumerate(layout.hosts):
        argv = [
            "torchrun",
            "--nnodes",
            str(layout.nodes),
            "--nproc_per_node",
            str(layout.train_gpus),
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{layout.hosts[0]}:{TRAIN_PORT}",
            "-m",
            "osvl.train",
            "--recipe",
            recipe_arg,
        ]
        for item in overrides:
            argv += ["--set", item]
        visible = ",".join(str(i) for i in range(layout.train_gpus))
        commands.append(
            Command(
                host,
                f"trainer ranks {node * layout.train_gpus}..{(node + 1) * layout.train_gpus - 1}",
                tuple(argv),
                (("CUDA_VISIBLE_DEVICES", visible),),
            )
        )
    return commands


def _port(url: str, what: str) -> int:
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"{what} {url!r} names no port for the loopback service to listen on")
    return port


def loopback_services(recipe: Recipe, any_ports: bool = False) -> list[ServiceSpec]:
    """The CPU form's services, listening where the recipe's URLs point (``any_ports``: free ports):
    the SGLang-protocol server, the tool server and, for LLM judges, the loopback judge."""
    r, t = recipe.rollout, recipe.tools
    if not recipe.model.pretrained:
        raise ValueError("model.pretrained must name the HF checkpoint the loopback server serves")
    if not t.world_dir:
        raise ValueError("tools.world_dir must name the offline world the loopback tool server serves")
    llm = "llm" in (recipe.judges.accuracy, recipe.judges.query)
    ports = (
        [0] * 3
        if any_ports
        else [
            _port(r.sglang_urls[0], "rollout.sglang_urls[0]") if r.sglang_urls else SGLANG_PORT,
            _port(t.servers[0], "tools.servers[0]") if t.servers else TOOL_PORT,
            _port(recipe.judges.url, "judges.url") if llm and recipe.judges.url else JUDGE_PORT,
        ]
    )
    engine = (sys.executable, "-m", "osvl.rollout.loopback", "--model-path", recipe.model.pretrained)
    tools = (sys.executable, "-m", "osvl.tools.server", "--world", t.world_dir, "--workers", str(t.workers))
    specs = [
        ServiceSpec("SGLang loopback", (*engine, "--max-batch", str(r.max_in_flight)), ports[0]),
        ServiceSpec("tool server", tools, ports[1]),
    ]
    if llm:
        specs.append(ServiceSpec("loopback judge", (sys.executable, "-m", "osvl.rl.loopback_judge"), ports[2]))
    return specs


def loopback_overrides(recipe: Recipe, urls: list[str]) -> list[str]:
    """The trainer's ``--set`` overrides for the URLs the loopback services came up on."""
    overrides = [f"rollout.sglang_urls={json.dumps([urls[0]])}", f"tools.servers={json.dumps([urls[1]])}"]
    if "llm" in (recipe.judges.accuracy, recipe.judges.query):
        overrides.append(f"judges.url={urls[2]}")
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="a GRPO recipe name in recipes/ or a .toml path")
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
