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

    def close(self, run: Runner) -> None:
        self.sync.close()
        if isinstance(self.engine, SGLangEngine | VLLMEngine):
            run(self.engine.aclose())


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
            build_model(arch, init=False),
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
    return Serving(engine, sync)


@dataclass(frozen=True)
class ServingPlan:
    """The serving side of a recipe, per SGLang server and per rollout step."""

    params: int
    servers: int
    server_tp: int
    weight_gib_per_gpu: float  # bf16 weights of one tensor-parallel shard
    kv_cache_gib_per_gpu: float  # what --mem-fraction-static leaves for the KV cache
    kv_tokens_per_server: int  # tokens of context the KV cache holds
    context_tokens: int  # one trajectory's longest context (prompt + response budget)
    sync_bytes_per_step: int  # weight bytes one server receives per rollout step
    updates_per_step: int  # optimizer steps per rollout step (one sync after the last: nothing generates between)

    def lines(self) -> list[str]:
        gib = 2**30
        fits = self.kv_tokens_per_server // max(self.context_tokens, 1)
        lines = [
            f"serving: {self.servers} SGLang server(s) x TP {self.server_tp}; {self.params / 1e9:.2f}B params, "
            f"{self.weight_gib_per_gpu:.2f} GiB bf16 weights per GPU",
            f"KV cache {self.kv_cache_gib_per_gpu:.2f} GiB per GPU = {self.kv_tokens_per_server:,} tokens per server: "
            f"{fits} trajectories at the full {self.context_tokens:,}-token context at once",
            f"weight sync: {self.sync_bytes_per_step / gib:.2f} GiB to each server per rollout step (once, after its "
            f"{self.updates_per_step} optimizer step(s); the servers' version counts optimizer steps)",
        ]
        if self.kv_cache_gib_per_gpu <= 0:
            lines.append(
                "the weights alone exceed rollout.server_mem_fraction of a server GPU: raise rollout.server_tp"
            )
        elif fits < 1:
            lines.append(
                "one full-length trajectory does not fit a server's KV cache: raise rollout.server_tp or "
                "rollout.server_mem_fraction, or lower grpo.max_response_tokens"
            )
        return lines


def serving_plan(recipe: Recipe, arch: Qwen3VLConfig) -> ServingPlan:
    """Weights, KV cache and sync traffic of the recipe's SGLang servers (bf16 weights and KV)."""
    r, g, t = recipe.rollout, recipe.grpo, arch.text
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(arch, init=False, device="meta").parameters())
    weight_bytes = 2 * params
    gpu = r.server_gpu_gib * 2**30
    kv_room = r.server_mem_fraction * gpu - weight_bytes / r.server_tp
    kv_per_token = 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * 2 / r.server_tp
    updates = g.batch_prompts // g.mini_batch_prompts
    return ServingPlan(
        params=params,
        servers=len(r.sglang_update_urls or r.sglang_urls) or 1,
        server_tp=r.server_tp,
        weight_gib_per_gpu=weight_bytes / r.server_tp / 2**30,
        kv_cache_gib_per_gpu=kv_room / 2**30,
        kv_tokens_per_server=max(int(kv_room / kv_per_token), 0),
        context_tokens=g.max_prompt_tokens + g.max_response_tokens,
        sync_bytes_per_step=weight_bytes,
        updates_per_step=updates,
    )
