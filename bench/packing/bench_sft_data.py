"""SFT data on one data-parallel rank: every sequence rendered with its pixels (the baseline, what
osvl did before deferred images) vs tokens laid out from the image headers and pixels made for the
rank's own micro-batches only, each image once. Both run in the same process on the same corpus;
the ratios are the result.

Each arm: load the file, then pack one epoch of this rank's micro-batches (``rank_microbatches``).
Reported per arm: seconds to load, seconds to pack the epoch, image decodes, and the bytes of
resized pixels held once loading is done (the baseline holds every image of every sequence).

    python -m bench.packing.bench_sft_data [--data runs/demo/data/sft/with_drills.jsonl --tokenizer ...]

Without ``--data`` a synthetic corpus is written: trajectories that share a pool of images, as the
curated SFT data does (the demo's names 534 files in 3,366 places).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.kernels.report import git_info
from osvl.data.chat import ChatRenderer
from osvl.data.formats import tokenize_steps
from osvl.data.image import ImageConfig, ProcessedImage
from osvl.data.image_files import ImageFileCache
from osvl.data.packing import TrainSequence, train_sequence
from osvl.data.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer
from osvl.jsonl import iter_jsonl
from osvl.rl.trajectory import FinishReason, Prompt, Step, ToolCall, ToolResult, Trajectory, append_jsonl, read_jsonl
from osvl.trainer.index_stream import IndexStream
from osvl.trainer.sft_data import load_sft_sequences, rank_microbatches

SCHEMA = "osvl.bench.sft_data/1"
REPO = Path(__file__).resolve().parents[2]
PATCH_SIZE = 8  # the demo's `small` preset; tiny_sft's data.min_pixels / max_pixels below


def synthetic_corpus(root: Path, num_trajectories: int, num_images: int, seed: int = 0) -> tuple[Path, Path]:
    """``sft.jsonl`` (with its image store) and ``tokenizer.json``: each trajectory has a prompt image
    and a cropped-image observation, both drawn from a shared pool of 384x512 images."""
    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, 256, (384, 512, 3), dtype=np.uint8) for _ in range(num_images)]
    trajectories = []
    for i in range(num_trajectories):
        photo, crop = pool[rng.integers(num_images)], pool[rng.integers(num_images)]
        search = ToolCall("text_search", {"query": f"landmark {i}"})
        steps = [
            Step(
                token_ids=[],
                logprobs=[],
                text=f"<think>find landmark {i}</think>\n<tool_call>{json.dumps(search.arguments)}</tool_call>",
                tool_call=search,
                tool_result=ToolResult(status="ok", tool="text_search", images=[crop]),
                observation_text=f"Landmark {i} was built in {1800 + i % 200}.",
                observation_images=[crop],
            ),
            Step(token_ids=[], logprobs=[], text=f"<response>{1800 + i % 200}</response>", response=str(1800 + i)),
        ]
        prompt = Prompt(id=f"q{i}", question=f"When was landmark {i} built?", images=[photo], answer=str(1800 + i))
        trajectories.append(
            Trajectory(prompt=prompt, steps=steps, finish_reason=FinishReason.RESPONSE, group_id=i, sample_index=0)
        )
    data = root / "sft.jsonl"
    append_jsonl(data, trajectories)
    corpus = [s.text for t in trajectories for s in t.steps] + [t.prompt.question for t in trajectories]
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(corpus, vocab_size=512).save(tokenizer)
    return data, tokenizer


def held_bytes(sequences: list[TrainSequence]) -> int:
    """Resized pixels the sequences hold now (a deferred image holds none until it is packed)."""
    arrays = {
        id(image.pixels): image.pixels.nbytes
        for s in sequences
        for image in s.images
        if isinstance(image, ProcessedImage)
    }
    return sum(arrays.values())


def referenced_images(data: Path) -> int:
    """Images ``read_jsonl`` decodes: every reference of every record (prompt, observations, tool results)."""
    count = 0
    for _, record in iter_jsonl(data):
        count += len(record["prompt"]["images"])
        for step in record["steps"]:
            result = step["tool_result"] or {"images": []}
            count += len(step["observation_images"]) + len(result["images"])
    return count


def pack_epoch(
    sequences: list[TrainSequence], renderer: ChatRenderer, ranks: int, batch: int, max_tokens: int
) -> float:
    stream = IndexStream(len(sequences), batch, seed=0)
    started = time.perf_counter()
    for _ in range(stream.steps_per_epoch):
        rank_microbatches(sequences, stream.next_batch(), max_tokens, ranks, 0, renderer)
    return time.perf_counter() - started


def image_config(patch_size: int) -> ImageConfig:
    return ImageConfig(patch_size=patch_size, min_pixels=1024, max_pixels=16384)


def eager_arm(data: Path, renderer: ChatRenderer, ranks: int, batch: int, max_tokens: int) -> dict:
    tokenizer = renderer.tokenizer
    started = time.perf_counter()
    sequences = [
        train_sequence(tokenize_steps(t, tokenizer, keep_token_ids=True), renderer, reward=0.0)
        for t in read_jsonl(data)
    ]
    load_s = time.perf_counter() - started
    return {
        "load_s": load_s,
        "pack_epoch_s": pack_epoch(sequences, renderer, ranks, batch, max_tokens),
        "image_decodes": referenced_images(data),
        "pixel_bytes_held_after_load": held_bytes(sequences),
        "tokens": sum(s.num_tokens for s in sequences),
    }


def deferred_arm(data: Path, renderer: ChatRenderer, ranks: int, batch: int, max_tokens: int) -> dict:
    cache = ImageFileCache()
    started = time.perf_counter()
    sequences = load_sft_sequences(data, renderer, image_cache=cache)
    load_s = time.perf_counter() - started
    decoded_while_loading = cache.num_decoded
    return {
        "load_s": load_s,
        "pack_epoch_s": pack_epoch(sequences, renderer, ranks, batch, max_tokens),
        "image_decodes": cache.num_decoded,
        "decodes_during_load": decoded_while_loading,
        "pixel_bytes_held_after_load": held_bytes(sequences),
        "image_files": cache.num_files,
        "tokens": sum(s.num_tokens for s in sequences),
    }


def run(
    data: Path, tokenizer: Tokenizer, ranks: int, batch: int, max_tokens: int, patch_size: int = PATCH_SIZE
) -> dict:
    renderer = ChatRenderer(tokenizer, image_config(patch_size))
    eager = eager_arm(data, renderer, ranks, batch, max_tokens)
    deferred = deferred_arm(data, renderer, ranks, batch, max_tokens)
    if eager["tokens"] != deferred["tokens"]:
        raise RuntimeError(f"the two arms laid out different token counts: {eager['tokens']} vs {deferred['tokens']}")
    total = {name: arm["load_s"] + arm["pack_epoch_s"] for name, arm in (("eager", eager), ("deferred", deferred))}
    return {
        "schema": SCHEMA,
        "git": git_info(REPO),
        "data": str(data),
        "ranks": ranks,
        "global_batch": batch,
        "max_tokens": max_tokens,
        "patch_size": patch_size,
        "eager": eager,
        "deferred": deferred,
        "load_speedup": eager["load_s"] / deferred["load_s"],
        "load_plus_epoch_speedup": total["eager"] / total["deferred"],
        "decode_ratio": eager["image_decodes"] / max(deferred["image_decodes"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="an osvl SFT JSONL (default: a synthetic corpus)")
    parser.add_argument("--tokenizer", type=Path, help="its tokenizer.json (required with --data)")
    parser.add_argument("--trajectories", type=int, default=1200, help="synthetic corpus size")
    parser.add_argument("--images", type=int, default=120, help="synthetic image pool size")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--patch-size", type=int, default=PATCH_SIZE, help="the vision tower's patch")
    parser.add_argument("--out", type=Path, default=REPO / "bench/packing/results/sft_data-cpu.json")
    args = parser.parse_args()
    if (args.data is None) != (args.tokenizer is None):
        parser.error("--data and --tokenizer go together")
    if min(args.trajectories, args.images, args.ranks, args.global_batch, args.max_tokens, args.patch_size) < 1:
        parser.error("--trajectories, --images, --ranks, --global-batch, --max-tokens and --patch-size must be >= 1")
    with tempfile.TemporaryDirectory() as scratch:
        data, tokenizer = (
            (args.data, args.tokenizer)
            if args.data is not None
            else synthetic_corpus(Path(scratch), args.trajectories, args.images)
        )
        result = run(data, load_tokenizer(tokenizer), args.ranks, args.global_batch, args.max_tokens, args.patch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
