"""Rollout throughput: trajectories/s and engine tokens/s, in-process (with and without the prefix
cache) vs 1 and 2 worker processes.

The tiny Qwen3-VL (random weights) samples multi-turn rollouts with images through the KV-cached
local engine; its outputs are mostly malformed actions, so rollouts run to the fatal rule or the
turn cap, which makes the workload decode-bound, as real rollouts are. Every configuration rolls
out the same prompts with the same seeds in one process run; ratios against the in-process
baseline are the result. Worker start-up is reported apart from the timed streams.

    python -m bench.rollout.bench_rollout [--prompts 4] [--group-size 2] [--repeats 5] [--out bench/rollout/results/...]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from bench.kernels.report import git_info
from bench.rollout.worker_pool import RolloutSetup, RolloutWorkerPool, WorkerPoolConfig
from osvl.data.chat import ChatRenderer
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.model import Qwen3VLConfig, TextConfig, VisionConfig, build_model
from osvl.rl.trajectory import Prompt, ToolResult, ToolStatus
from osvl.rollout import (
    AgentConfig,
    LocalEngine,
    RolloutMetrics,
    RolloutWorkerConfig,
    SamplingParams,
    stream_groups,
)
from osvl.tools import ToolEnvironment, ToolRegistry

SCHEMA = "osvl.bench.rollout/1"
REPO = Path(__file__).resolve().parents[2]
IMAGE_CONFIG = ImageConfig(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=64)
CORPUS = [
    '<think>look</think>\n<tool_call>\n{"name": "search", "arguments": {"q": "bridge"}}\n</tool_call>',
    "<think>Done.</think>\n<response>1982</response>",
    "Which bridge is shown in the image?",
] * 10


class NoTools:
    """No tool ever runs: the workload measures generation, not tools."""

    def call(self, job) -> ToolResult:
        return ToolResult(status=ToolStatus.TOOL_ERROR, tool=job.tool, error="no tools in this benchmark")

    async def acall(self, job) -> ToolResult:
        return self.call(job)


def build_setup(group_size: int, max_new_tokens: int, threads: int, prefix_cache_tokens: int = 0) -> RolloutSetup:
    """Built in every worker (and once in-process); the same seed gives every copy the same weights."""
    torch.set_num_threads(threads)
    tok = train_bpe_tokenizer(CORPUS, vocab_size=400)
    s = tok.special
    text = TextConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mrope_section=(4, 2, 2),
    )
    vision = VisionConfig(
        depth=1,
        hidden_size=16,
        intermediate_size=24,
        num_heads=2,
        patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=(0,),
    )
    torch.manual_seed(0)
    model = build_model(
        Qwen3VLConfig(
            text=text,
            vision=vision,
            image_token_id=s.image_pad,
            video_token_id=s.video_pad,
            vision_start_token_id=s.vision_start,
            vision_end_token_id=s.vision_end,
        )
    )
    env = ToolEnvironment(ToolRegistry([]), NoTools())
    return RolloutSetup(
        engine=LocalEngine(model, tok, IMAGE_CONFIG, max_batch=16, prefix_cache_tokens=prefix_cache_tokens),
        env=env,
        renderer=ChatRenderer(tok, IMAGE_CONFIG, []),
        agent=AgentConfig(max_turns=4, sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)),
        rollout=RolloutWorkerConfig(group_size=group_size, max_in_flight=64, max_retries=0),
    )


def make_prompts(n: int) -> list[Prompt]:
    rng = np.random.default_rng(0)
    return [
        Prompt(
            id=f"b{i}",
            question=f"Which bridge is shown in the image? ({i})",
            images=[rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)],
            answer="1982",
        )
        for i in range(n)
    ]


def summarize(metrics: RolloutMetrics, seconds: float) -> dict:
    return {
        "seconds": seconds,
        "trajectories": metrics.trajectories,
        "engine_tokens": metrics.engine_tokens,
        "trajectories_per_s": metrics.trajectories / seconds,
        "engine_tokens_per_s": metrics.engine_tokens / seconds,
        "turns_mean": metrics.turns / max(metrics.trajectories, 1),
    }


def timed(stream) -> dict:
    metrics = RolloutMetrics()
    start = time.perf_counter()
    stream(metrics)
    return summarize(metrics, time.perf_counter() - start)


def in_process_stream(setup: RolloutSetup, prompts: list[Prompt]):
    def run(metrics: RolloutMetrics) -> None:
        async def collect():
            return [
                g
                async for g in stream_groups(
                    prompts, setup.engine, setup.env, setup.renderer, setup.agent, setup.rollout, metrics=metrics
                )
            ]

        asyncio.run(collect())

    return run


def pool_stream(pool: RolloutWorkerPool, prompts: list[Prompt]):
    return lambda metrics: list(pool.stream(prompts, metrics=metrics))


def median_run(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return {**best, "seconds_all": [r["seconds"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description="rollout throughput, in-process vs worker processes")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    prompts = make_prompts(args.prompts)
    setup = build_setup(args.group_size, args.max_new_tokens, cores)
    cached = build_setup(args.group_size, args.max_new_tokens, cores, prefix_cache_tokens=1 << 20)
    streams = {
        "in_process": in_process_stream(setup, prompts),
        "in_process_prefix_cache": in_process_stream(cached, prompts),
    }
    pools, startup = {}, {}
    for workers in (1, 2):  # each worker gets its share of the cores
        factory = functools.partial(build_setup, args.group_size, args.max_new_tokens, max(1, cores // workers))
        start = time.perf_counter()
        pools[workers] = RolloutWorkerPool(
            factory, WorkerPoolConfig(num_workers=workers, groups_per_worker=args.prompts)
        )
        startup[workers] = time.perf_counter() - start
        streams[f"workers_{workers}"] = pool_stream(pools[workers], prompts)
    try:
        for stream in streams.values():  # warm-up
            timed(stream)
        samples: dict[str, list[dict]] = {name: [] for name in streams}
        for _ in range(args.repeats):  # interleaved, so load drifts hit every configuration alike
            for name, stream in streams.items():
                samples[name].append(timed(stream))
    finally:
        for pool in pools.values():
            pool.close()
    runs = {name: median_run(r) for name, r in samples.items()}
    baseline = runs["in_process"]
    for run in runs.values():
        run["ratio_vs_in_process"] = run["trajectories_per_s"] / baseline["trajectories_per_s"]
    for workers, seconds in startup.items():
        runs[f"workers_{workers}"]["startup_s"] = seconds
    git = git_info(REPO)
    result = {
        "schema": SCHEMA,
        "git": git,
        "device": platform.processor() or platform.machine(),
        "cpu_count": cores,
        "torch": torch.__version__,
        "workload": {
            "prompts": args.prompts,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "max_turns": 4,
            "repeats": args.repeats,
        },
        "runs": runs,
    }
    out = args.out or REPO / f"bench/rollout/results/rollout-cpu-{git['short']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
