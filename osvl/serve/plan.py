"""What a recipe's SGLang servers hold and receive: bf16 weights and KV cache per GPU, trajectories that
fit the KV cache at the full context, and the weight bytes each server receives per rollout step
(``python -m osvl.train --recipe R --dry-run``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osvl.config.recipe import Recipe
from osvl.model import Qwen3VLConfig, build_model


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
