"""The commands that start the service side of a GRPO recipe on a cluster, per node.

Per node: the inference servers (SGLang, with an optional sglang-router, or vLLM with ``--engine
vllm``), the tool server, and the trainer's ``torchrun`` with the ``--set`` overrides that point it at
them. Every flag that must agree with the trainer comes from the recipe: the checkpoint the servers
load (``model.pretrained``), the image processor's pixel budget (its ``preprocessor_config.json``,
also passed as SGLang's ``--mm-process-config`` / vLLM's ``--mm-processor-kwargs``), the context
length (``grpo.max_prompt_tokens + max_response_tokens``), the servers' TP size and memory fraction,
and the weight-update route. vLLM servers also get what osvl's client needs: the RL and RPC routes
(``VLLM_SERVER_DEV_MODE=1``), the token-in/token-out route (``--enable-scale-out``), logprobs after
temperature (``--logprobs-mode processed_logprobs``), request sampling without the checkpoint's
defaults (``--generation-config vllm``), and NCCL weight transfer for ``rollout.weight_sync =
"distributed"``.

Layout: on every node the first ``--train-gpus`` GPUs run trainer ranks and the others run SGLang
servers of ``rollout.server_tp`` GPUs each.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from osvl.config import Recipe
from osvl.data.image import ImageConfig

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
            "online",  # the shipped osvl/recipes/tools/online.toml, by name: a pip install has no such folder
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
