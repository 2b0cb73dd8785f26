"""The GRPO stage's side of the serving topology: the engine its rollouts talk to, and how the
trainer's weights reach that engine after every optimizer step.

``rollout.engine = "local"`` (CPU form): every rank keeps an unsharded generation copy of the
policy in a ``LocalEngine`` and syncs it in memory. ``rollout.engine = "sglang"``: rollouts go to
the SGLang fleet (``rollout.sglang_urls``) and no generation copy lives in trainer memory; the
weights travel from disk (``rollout.weight_sync = "disk"``) or by broadcast (``"distributed"``)
to the servers of ``rollout.sglang_update_urls`` (default: ``sglang_urls``), in the dtype the
trainer computes with (``parallel.param_dtype``). ``rollout.engine = "vllm"``: the same over vLLM
servers (``rollout.vllm_urls``); ``disk`` reloads through vLLM's ``/collective_rpc`` (the path that
works on CPU), ``distributed`` is vLLM's NCCL weight transfer (GPUs). ``rollout.text_only_export``
writes the language model alone as a Qwen3 text checkpoint, what a vLLM CPU server serves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from osvl.config.recipe import Recipe
from osvl.data.distributed import rank_device
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import Tokenizer
from osvl.model import Qwen3VLConfig, build_model
from osvl.rollout import Engine, LocalEngine, SGLangConfig, SGLangEngine
from osvl.rollout.vllm import VLLMConfig, VLLMEngine
from osvl.rollout.weight_sync import DiskSync, DistributedSync, InProcessSync, Runner, VLLMNCCLSync, WeightSync

EngineWrapper = Callable[[LocalEngine], Engine]  # tests script the policy through a ReplayEngine


@dataclass
class Serving:
    engine: Engine  # what the rollouts call
    sync: WeightSync
    local: LocalEngine | None = None  # the CPU form's in-process engine
    remote: SGLangEngine | VLLMEngine | None = None  # the client of the recipe's inference servers

    def close(self, run: Runner) -> None:
        self.sync.close()
        if self.remote is not None:
            run(self.remote.aclose())

    async def take_restarts(self) -> int:
        """Inference servers seen going away and coming back since the last call (on the engine's loop);
        0 for the in-process engine, which cannot restart without the trainer."""
        return await self.remote.take_restarts() if self.remote is not None else 0


def weights_dir(recipe: Recipe) -> Path:
    return Path(recipe.rollout.weights_dir or Path(recipe.job.run_dir) / "weights")


def remote_engine(
    recipe: Recipe, arch: Qwen3VLConfig, decode: Callable[[Sequence[int]], str] | None = None
) -> SGLangEngine | VLLMEngine:
    """The client of the recipe's inference servers (``rollout.engine`` sglang or vllm); ``decode``
    (the tokenizer's) finds a stop string split across a continued (paused) generation."""
    r = recipe.rollout
    if r.engine == "vllm":
        return VLLMEngine(
            VLLMConfig(
                tuple(r.vllm_urls),
                tuple(r.vllm_update_urls),
                timeout_s=r.request_timeout_s,
                image_token_id=arch.image_token_id,
            )
        )
    return SGLangEngine(
        SGLangConfig(
            tuple(r.sglang_urls),
            tuple(r.sglang_update_urls),
            timeout_s=r.request_timeout_s,
            deterministic=r.deterministic,
            partial_rollouts=r.partial_rollouts,
            reconnect_s=r.server_reconnect_s,
        ),
        decode=decode,
    )


def build_serving(
    recipe: Recipe,
    arch: Qwen3VLConfig,
    tokenizer: Tokenizer,
    image_config: ImageConfig,
    run: Runner,
    engine_wrapper: EngineWrapper | None = None,
) -> Serving:
    r = recipe.rollout
    if r.engine == "local":
        local = LocalEngine(
            # on the rank's GPU in the compute dtype, as a server holds it; the weights come with the first sync
            build_model(arch, init=False, device=rank_device(), dtype=getattr(torch, recipe.parallel.param_dtype)),
            tokenizer,
            image_config,
            max_batch=r.max_in_flight,
            deterministic=r.deterministic,
        )
        return Serving(engine_wrapper(local) if engine_wrapper else local, InProcessSync(local), local)
    if engine_wrapper is not None:
        raise ValueError(f"engine_wrapper scripts the local engine; rollout.engine is {r.engine!r}")
    dtype = getattr(torch, recipe.parallel.param_dtype)
    engine = remote_engine(recipe, arch, decode=tokenizer.decode)
    pause = r.max_staleness > 0 and isinstance(engine, SGLangEngine)  # servers generate while the trainer trains
    sync: WeightSync
    if r.weight_sync == "disk":
        sync = DiskSync(engine, weights_dir(recipe), dtype, run, text_only=r.text_only_export, pause=pause)
    elif isinstance(engine, VLLMEngine):
        sync = VLLMNCCLSync(
            engine, dtype, run, bucket_bytes=r.weight_sync_bucket_mb << 20, text_only=r.text_only_export
        )
    else:
        sync = DistributedSync(
            engine,
            dtype,
            run,
            bucket_bytes=r.weight_sync_bucket_mb << 20,
            master_address=r.weight_sync_master_addr,
            master_port=r.weight_sync_port,
            backend="nccl" if torch.cuda.is_available() else "gloo",
            text_only=r.text_only_export,
            pause=pause,
        )
    return Serving(engine, sync, remote=engine)
