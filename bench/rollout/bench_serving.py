"""The serving topology's costs on CPU: rollout throughput through the SGLang protocol against the
in-process engine at equal work, and weight-sync seconds and bytes against model size.

Throughput: the same prompts and seeds roll out through (a) the in-process local engine and (b) an
SGLang-protocol server process (``python -m osvl.serve.loopback_engine``) over a checkpoint of the same
weights, interleaved over repeats; the ratio is the protocol's cost (JSON, PNG images, HTTP, a
process boundary). Weight sync: ``DiskSync`` and ``DistributedSync`` into a server process for
models of growing width; seconds are fitted as ``a + bytes / rate`` per path and extrapolated to
the bf16 weights of Qwen3-VL-8B and 30B-A3B. The extrapolation is for this CPU and loopback
network; a cluster's NVMe, network and NCCL set other rates (the same fit applies to its numbers).

    python -m bench.rollout.bench_serving [--repeats 3] [--out bench/rollout/results/serving-cpu-<commit>.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.kernels.report import git_info
from bench.rollout.bench_rollout import CORPUS, IMAGE_CONFIG, NoTools, make_prompts, median_run, summarize
from osvl.data.chat import ChatRenderer
from osvl.data.formats.processor import PREPROCESSOR_FILE
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.model import Qwen3VLConfig, TextConfig, VisionConfig, build_model, save_pretrained
from osvl.model.presets import preset
from osvl.rollout import (
    AgentConfig,
    LocalEngine,
    RolloutMetrics,
    RolloutWorkerConfig,
    SamplingParams,
    SGLangConfig,
    SGLangEngine,
    stream_groups,
)
from osvl.rollout.weight_sync import DiskSync, DistributedSync
from osvl.tools import ToolEnvironment, ToolRegistry

SCHEMA = "osvl.bench.serving/1"
REPO = Path(__file__).resolve().parents[2]
WIDTHS = {"tiny": (64, 2), "small": (128, 2), "medium": (512, 4), "large": (1024, 4)}  # (hidden, layers)


def model_config(tok, hidden: int, layers: int) -> Qwen3VLConfig:
    s = tok.special
    text = TextConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        mrope_section=(hidden // 16, hidden // 32, hidden // 32),
    )
    vision = VisionConfig(
        depth=1,
        hidden_size=16,
        intermediate_size=24,
        num_heads=2,
        patch_size=2,
        out_hidden_size=hidden,
        num_position_embeddings=16,
        deepstack_visual_indexes=(0,),
    )
    return Qwen3VLConfig(
        text=text,
        vision=vision,
        image_token_id=s.image_pad,
        video_token_id=s.video_pad,
        vision_start_token_id=s.vision_start,
        vision_end_token_id=s.vision_end,
    )


def write_checkpoint(model, tok, path: Path) -> Path:
    save_pretrained(model, path, dtype=torch.float32)
    tok.save(path / "tokenizer.json")
    (path / PREPROCESSOR_FILE).write_text(json.dumps(IMAGE_CONFIG.to_preprocessor_config()))
    return path


def start_server(path: Path, directory: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    ready = directory / f"ready-{path.name}"
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "osvl.serve.loopback_engine",
            "--model-path",
            str(path),
            "--port",
            "0",
            "--max-batch",
            str(max_batch),
            "--ready-file",
            str(ready),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not ready.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the loopback server did not start")
        time.sleep(0.1)
    return process, ready.read_text()


def throughput(args, tok, directory: Path) -> dict:
    torch.manual_seed(0)
    model = build_model(model_config(tok, *WIDTHS["tiny"]))
    path = write_checkpoint(model, tok, directory / "throughput")
    prompts = make_prompts(args.prompts)
    renderer = ChatRenderer(tok, IMAGE_CONFIG, [])
    agent = AgentConfig(max_turns=4, sampling=SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens))
    rollout = RolloutWorkerConfig(group_size=args.group_size, max_in_flight=64, max_retries=0)
    env = ToolEnvironment(ToolRegistry([]), NoTools())
    local = LocalEngine(model, tok, IMAGE_CONFIG, max_batch=16)
    process, url = start_server(path, directory, 16)
    try:
        with asyncio.Runner() as runner:
            remote = SGLangEngine(SGLangConfig((url,)))
            engines = {"in_process": local, "sglang_protocol": remote}

            def once(engine) -> dict:
                metrics = RolloutMetrics()

                async def collect():
                    return [
                        g async for g in stream_groups(prompts, engine, env, renderer, agent, rollout, metrics=metrics)
                    ]

                start = time.perf_counter()
                runner.run(collect())
                return summarize(metrics, time.perf_counter() - start)

            for engine in engines.values():  # warm-up
                once(engine)
            samples: dict[str, list[dict]] = {name: [] for name in engines}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    samples[name].append(once(engine))
            runner.run(remote.aclose())
    finally:
        process.kill()
        process.wait(30)
    runs = {name: median_run(r) for name, r in samples.items()}
    base = runs["in_process"]
    for run in runs.values():
        run["ratio_vs_in_process"] = run["engine_tokens_per_s"] / base["engine_tokens_per_s"]
    return runs


def weight_sync(args, tok, directory: Path) -> dict:
    out = {}
    for name in args.sizes:
        torch.manual_seed(1)
        policy = build_model(model_config(tok, *WIDTHS[name]))
        served = write_checkpoint(build_model(model_config(tok, *WIDTHS[name])), tok, directory / f"served-{name}")
        process, url = start_server(served, directory, 1)
        try:
            with asyncio.Runner() as runner:
                client = SGLangEngine(SGLangConfig((url,)))
                disk = DiskSync(client, directory / f"weights-{name}", torch.float32, runner.run)
                broadcast = DistributedSync(
                    client, torch.float32, runner.run, bucket_bytes=args.bucket_mb << 20, master_address="127.0.0.1"
                )
                rows = {"disk": [], "distributed": []}
                for version in range(1, args.repeats + 2):  # the first of each is a warm-up
                    rows["disk"].append(disk.sync(policy, 2 * version))
                    rows["distributed"].append(broadcast.sync(policy, 2 * version + 1))
                broadcast.close()
                runner.run(client.aclose())
        finally:
            process.kill()
            process.wait(30)
        params = sum(p.numel() for p in policy.parameters())
        out[name] = {
            "params": params,
            **{
                path: {
                    "bytes": stats[-1].bytes,
                    "seconds_median": float(np.median([s.seconds for s in stats[1:]])),
                    "seconds_all": [s.seconds for s in stats],
                }
                for path, stats in rows.items()
            },
        }
    return out


def extrapolate(sync: dict) -> dict:
    """seconds = a + bytes / rate per path (least squares over the measured sizes), at the paper models' bf16 bytes."""
    targets = {}
    for name in ("qwen3_vl_8b", "qwen3_vl_30b_a3b"):
        with torch.device("meta"):
            params = sum(p.numel() for p in build_model(preset(name), init=False, device="meta").parameters())
        targets[name] = {"params": params, "bf16_bytes": 2 * params}
    fits = {}
    for path in ("disk", "distributed"):
        x = np.array([row[path]["bytes"] for row in sync.values()], dtype=np.float64)
        y = np.array([row[path]["seconds_median"] for row in sync.values()])
        slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 else (y[0] / x[0], 0.0)
        fits[path] = {
            "fixed_s": float(intercept),
            "bytes_per_s": float(1 / slope) if slope > 0 else None,
            **{name: float(intercept + slope * t["bf16_bytes"]) for name, t in targets.items()},
        }
    return {"targets": targets, "fit_seconds": fits}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    tok = train_bpe_tokenizer(CORPUS, vocab_size=400)
    with tempfile.TemporaryDirectory(prefix="osvl-bench-serving-") as directory:
        runs = throughput(args, tok, Path(directory))
        sync = weight_sync(args, tok, Path(directory))
    git = git_info(REPO)
    result = {
        "schema": SCHEMA,
        "git": git,
        "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "workload": {
            "prompts": args.prompts,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "max_turns": 4,
            "repeats": args.repeats,
            "bucket_mb": args.bucket_mb,
        },
        "throughput": runs,
        "weight_sync": sync,
        "extrapolation": extrapolate(sync),
    }
    out = args.out or REPO / f"bench/rollout/results/serving-cpu-{git['short']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                "throughput": {k: v["ratio_vs_in_process"] for k, v in runs.items()},
                "extrapolation": result["extrapolation"]["fit_seconds"],
            },
            indent=2,
        )
    )
    return result


if __name__ == "__main__":
    main()
