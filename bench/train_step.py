"""One training step of a Qwen3-VL at a released width, cut to a few decoder layers, on one device:
tokens/s, MFU, peak memory and the share of the step spent in the fused GRPO loss.

    python bench/train_step.py              # CUDA: qwen3_vl_8b width (real vocabulary, full vision tower),
                                            # 4 decoder layers, 16k packed tokens with images, full AC, bf16
    python bench/train_step.py --smoke      # any machine: the tiny CPU width, 512 tokens, fp32

The step is the trainer's: FSDP2 mixed precision (fp32 master weights, bf16 compute) on a one-rank
mesh, torchtitan's activation checkpointing, then osvl.step, which the stages call for their own
steps: the packed multimodal forward, the fused GRPO loss on the final hidden states with the stage's
settings and loss chunk, backward, and `optim_step` (clip, the non-finite guard, AdamW as the trainer
builds it). The batch is synthetic (random weights, random token
ids, random pixels) with the shapes of real trajectories: several sequences, each with images,
about half its tokens policy tokens. FLOPs come from osvl.trainer.flops on the actual packed
lengths and image grids. Writes <out-dir>/<name>-<gpu|cpu>-<commit>.json once the model is built and
again after every step (`"complete": false` until the last), so a run cut short keeps its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: the repo, not bench/ (whose profile.py shadows the stdlib's)
    sys.path[0] = str(REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.kernels.report import device_tag, git_info, result_path, versions, write_record  # noqa: E402
from osvl.config.recipe import GRPOConfig  # noqa: E402  (the recipe config: no torch, no other osvl package)

SCHEMA = "osvl.bench.train_step/1"
TINY_VOCAB = 4096
# Qwen3-VL's added-token ids (tokenizer_config.json of the released checkpoints).
QWEN3_VL_SPECIAL = dict(
    endoftext=151643,
    im_start=151644,
    im_end=151645,
    vision_start=151652,
    vision_end=151653,
    image_pad=151655,
    video_pad=151656,
    tool_call_start=151657,
    tool_call_end=151658,
    tool_response_start=151665,
    tool_response_end=151666,
    think_start=151667,
    think_end=151668,
)


@dataclass(frozen=True)
class StepConfig:
    preset: str  # a released width (osvl.model.presets) or "tiny"
    layers: int  # decoder layers kept
    tokens: int  # packed LLM tokens in the micro-batch, image tokens included
    seqs: int
    images_per_seq: int
    image_side: int  # pixels; the image is square
    activation_checkpoint: str
    param_dtype: str
    attn_backend: str
    steps: int  # the first is a warm-up
    loss_chunk: int | None


def parse_args(argv: list[str]) -> tuple[StepConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny width on any device (what tests/bench runs)")
    p.add_argument("--preset", default=None, help="qwen3_vl_8b (default on CUDA), qwen3_vl_32b, or tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=None, help="default 16384 (512 with --smoke)")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--images-per-seq", type=int, default=1)
    p.add_argument("--image-side", type=int, default=None, help="default 448 px (32 with --smoke)")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="full")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--loss-chunk", type=int, default=GRPOConfig().loss_chunk, help="grpo.loss_chunk (the recipes' default)"
    )
    p.add_argument("--peak-tflops", type=float, default=0.0, help="0: from the device table")
    p.add_argument("--name", default="train_step")
    p.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or REPO / "bench" / "results"))
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    config = StepConfig(
        preset=a.preset or ("tiny" if a.smoke else "qwen3_vl_8b"),
        layers=a.layers,
        tokens=a.tokens or (512 if a.smoke else 16384),
        seqs=a.seqs,
        images_per_seq=a.images_per_seq,
        image_side=a.image_side or (32 if a.smoke else 448),
        activation_checkpoint=a.ac,
        param_dtype="bfloat16" if cuda else "float32",
        attn_backend="varlen" if cuda else "sdpa",
        steps=a.steps,
        loss_chunk=a.loss_chunk,
    )
    if config.layers < 1 or config.steps < 2 or config.seqs < 1 or config.images_per_seq < 0:
        raise ValueError("need --layers >= 1, --steps >= 2 (one warm-up), --seqs >= 1, --images-per-seq >= 0")
    if config.preset == "tiny" and cuda:
        raise ValueError("--preset tiny is the CPU width; pass --smoke")
    return config, a


def architecture(config: StepConfig):
    """The preset with `layers` decoder layers (DeepStack keeps the injections that still have a layer)."""
    from osvl.data.tokenizer import SpecialTokens
    from osvl.model.presets import preset
    from osvl.trainer.policy import tiny_arch

    if config.preset == "tiny":  # a small vocabulary keeps the CPU smoke run short; its added tokens at the top
        special = SpecialTokens(**{k: TINY_VOCAB - 16 + i for i, k in enumerate(QWEN3_VL_SPECIAL)})
        arch = tiny_arch(TINY_VOCAB, special)
    else:
        special = SpecialTokens(**QWEN3_VL_SPECIAL)
        arch = preset(config.preset)
    text = replace(arch.text, num_hidden_layers=config.layers)
    vision = replace(arch.vision, deepstack_visual_indexes=arch.vision.deepstack_visual_indexes[: config.layers])
    return replace(arch, text=text, vision=vision), special


def synthetic_batch(config: StepConfig, arch, special, seed: int = 0):
    """A packed micro-batch of `seqs` trajectories, each: a prompt with its images, then alternating
    policy turns (loss tokens) and tool observations, with engine log-probs and group rewards."""
    from osvl.data.image import ImageConfig, ProcessedImage
    from osvl.data.packing import TrainSequence, pack_microbatch
    from osvl_kernels import group_advantages

    rng = np.random.default_rng(seed)
    v = arch.vision
    factor = v.patch_size * v.spatial_merge_size
    side = max(config.image_side // factor, 1) * factor
    images_cfg = ImageConfig(
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        merge_size=v.spatial_merge_size,
        min_pixels=factor**2,
        max_pixels=side**2,
    )
    grid = (1, side // v.patch_size, side // v.patch_size)
    image_tokens = grid[1] * grid[2] // v.spatial_merge_size**2
    base, extra = divmod(config.tokens, config.seqs)
    sequences = []
    for s in range(config.seqs):
        length = base + (s < extra)
        images = [
            ProcessedImage(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), grid, image_tokens)
            for _ in range(config.images_per_seq)
        ]
        vision = [special.vision_start, *[special.image_pad] * image_tokens, special.vision_end] * len(images)
        if len(vision) + 8 > length:
            raise ValueError(
                f"{config.tokens // config.seqs} tokens per sequence cannot hold "
                f"{config.images_per_seq} images of {image_tokens} tokens"
            )
        text = rng.integers(0, special.endoftext, length - len(vision) - 1)
        ids = np.concatenate([[special.im_start], vision, text]).astype(np.int64)
        turn = np.arange(length) * 8 // length  # eight turns: odd ones are the policy's
        loss_mask = (turn % 2 == 1) & (np.arange(length) > len(vision))
        logprobs = np.where(loss_mask, -rng.random(length), 0).astype(np.float32)
        sequences.append(
            TrainSequence(ids, loss_mask, turn // 2, logprobs, images, group_id=s // 4, reward=float(rng.random()))
        )
    # the trainer packs each sequence with its advantage, normalised over its group beforehand
    rewards = torch.tensor([seq.reward for seq in sequences])
    advantages = group_advantages(rewards, torch.tensor([seq.group_id for seq in sequences]))
    sequences = [replace(seq, advantage=float(a)) for seq, a in zip(sequences, advantages)]
    return pack_microbatch(sequences, images_cfg, special)


def one_rank_group(device: torch.device) -> None:
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def build(config: StepConfig, arch, device: torch.device):
    """The model as a one-rank trainer holds it: torchtitan AC, then FSDP2 units (decoder layers,
    vision blocks, the tower, the root) with fp32 master weights and `param_dtype` compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from osvl.parallel import ParallelConfig, parallel_dims, parallelize, sharded_model_config

    parallel = ParallelConfig(
        dp_shard=1, activation_checkpoint=config.activation_checkpoint, param_dtype=config.param_dtype
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = sharded_model_config(arch, parallel, attn_backend=config.attn_backend).build()
        with torch.no_grad():
            model.init_states()
    dims = parallel_dims(parallel, 1)
    dims.build_mesh()
    parallelize(model, dims, parallel)  # one rank: AC (and compile when asked), no data parallelism
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, config.param_dtype), reduce_dtype=torch.float32)
    for module in [*model.visual.blocks, model.visual, *model.layers.values(), model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    return model


class Clock:
    """Wall time of host code, CUDA-event time of device work (no sync until read)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def step_summary(steps: list[dict], tokens: int, flops: float, peak: float | None) -> dict:
    """Medians over the timed steps (the first is a warm-up); None until one has run."""
    from osvl.trainer.flops import mfu

    timed = steps[1:]
    if not timed:
        return dict.fromkeys(
            ("step_s", "tokens_per_s", "model_tflops_per_s", "mfu", "peak_memory_gib", "loss_time_share", "loss_s")
        )
    step_s = float(np.median([s["step_s"] for s in timed]))
    loss_s = float(np.median([s["loss_s"] for s in timed]))
    peaks = [s["peak_memory_bytes"] for s in timed if s["peak_memory_bytes"] is not None]
    return {
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_tflops_per_s": flops / step_s / 1e12,
        "mfu": mfu(flops, step_s, 1, peak),
        "peak_memory_gib": max(peaks) / 2**30 if peaks else None,
        "loss_time_share": loss_s / step_s,
        "loss_s": loss_s,
    }


def run(config: StepConfig, out_dir: Path, name: str, peak_tflops: float) -> tuple[dict, Path]:
    from osvl.config.recipe import OptimizerConfig, SchedulerConfig
    from osvl.data.distributed import global_normalizers
    from osvl.step import grpo_loss_config, grpo_loss_on_hidden, optim_step, packed_forward
    from osvl.trainer.flops import packed_batch_flops, resolve_peak_tflops
    from osvl.trainer.optim import build_optimizer, build_scheduler

    git = git_info(REPO)  # first: the file's name, and a failure here must not cost the steps
    device = torch.device("cuda" if config.param_dtype == "bfloat16" else "cpu")
    one_rank_group(device)
    arch, special = architecture(config)
    batch = synthetic_batch(config, arch, special).to(device)
    model = build(config, arch, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer_config = OptimizerConfig(lr=1e-6)
    optimizer = build_optimizer(params, optimizer_config)
    scheduler = build_scheduler(optimizer, config.steps, SchedulerConfig(kind="constant", warmup_ratio=0.0))
    loss_config = grpo_loss_config(GRPOConfig())  # the stage's settings (host-side value checks off)
    norms = global_normalizers([batch], device=device)
    flops = packed_batch_flops(arch, batch.to("cpu"))
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = resolve_peak_tflops(peak_tflops, gpu_name)
    steps = []
    record = {
        "schema": SCHEMA,
        "name": name,
        "complete": False,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git,
        "device": {"type": device.type, "name": gpu_name or "cpu", "peak_tflops": peak},
        "versions": versions(),
        "config": asdict(config),
        "model": {
            "params": sum(p.numel() for p in model.parameters()),
            "hidden": arch.text.hidden_size,
            "vocab": arch.text.vocab_size,
            "decoder_layers": arch.text.num_hidden_layers,
            "vision_depth": arch.vision.depth,
        },
        "batch": {
            "tokens": batch.num_tokens,
            "seqs": batch.num_seqs,
            "valid_tokens": batch.num_valid_tokens,
            "images": int(batch.image_grid_thw.shape[0]),
            "patches": int(batch.pixel_values.shape[0]),
        },
        "flops_per_step": flops,
        "steps": steps,
        "summary": step_summary(steps, batch.num_tokens, flops, peak),
    }
    path = result_path(out_dir, name, device_tag(device), git["short"])
    write_record(record, path)
    clock = Clock(device)
    for step in range(config.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = clock.mark()
        on_device, hidden = packed_forward(model, batch)
        t1 = clock.mark()
        out = grpo_loss_on_hidden(
            model,
            hidden,
            on_device,
            loss_config,
            chunk_size=config.loss_chunk,
            num_seqs=norms.num_seqs.clamp_min(1),
            num_tokens=norms.num_valid_tokens.clamp_min(1),
        )
        t2 = clock.mark()
        out.loss.backward()
        t3 = clock.mark()
        optim_step(params, optimizer, scheduler, optimizer_config)
        t4 = clock.mark()
        steps.append(
            {
                "step": step,
                "step_s": clock.seconds(t0, t4),
                "forward_s": clock.seconds(t0, t1),
                "loss_s": clock.seconds(t1, t2),
                "backward_s": clock.seconds(t2, t3),
                "optimizer_s": clock.seconds(t3, t4),
                "loss": float(out.loss.detach()),
                "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            }
        )
        print(json.dumps(steps[-1]), flush=True)
        record["summary"] = step_summary(steps, batch.num_tokens, flops, peak)
        record["complete"] = step == config.steps - 1
        write_record(record, path)
    return record, path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, a = parse_args(argv)
    except ValueError as error:
        print(f"train_step: {error}", file=sys.stderr)
        return 2
    try:
        record, path = run(config, a.out_dir, a.name, a.peak_tflops)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(record["summary"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
