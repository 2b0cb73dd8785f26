"""The SFT stage (paper Eq. 8): masked next-token loss on the policy's tokens of expert trajectories."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.distributed.utils import clip_grad_norm_

from osvl.config.recipe import Recipe
from osvl.data.packing import PackedBatch
from osvl.data.tokenizer import load_tokenizer
from osvl.trainer.checkpoint import (
    finish_stage,
    resume_state,
    save_checkpoint,
    stage_state,
)
from osvl.trainer.flops import device_name, mfu, packed_batch_flops, resolve_peak_tflops
from osvl.trainer.loss import sft_loss
from osvl.trainer.metrics import peak_memory_gib, stage_metrics
from osvl.trainer.optim import build_optimizer, build_scheduler
from osvl.trainer.policy import build_policy, lm_head_weight, policy_arch
from osvl.trainer.resume import resume_records
from osvl.trainer.sft_data import SFTStream, load_sft_sequences, rank_microbatches
from osvl.trainer.tool_env import stage_renderer


@dataclass(frozen=True)
class StageResult:
    steps: int  # optimizer steps taken in total (including those before a resume)
    resumed_from: int  # step of the checkpoint it resumed from; 0 = fresh start
    final_loss: float
    run_dir: Path


def _all_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value)
    return value


def _forward_loss(model, batch: PackedBatch, normalizer: int, chunk: int) -> torch.Tensor:
    hidden = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids,
                   pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw, return_hidden=True)
    return sft_loss(hidden, lm_head_weight(model), batch.target_ids, batch.loss_mask, normalizer, chunk)


def run_sft(recipe: Recipe, rank: int = 0, world_size: int = 1, stop_after: int | None = None) -> StageResult:
    """Train to the recipe's step count (or ``stop_after`` steps, to simulate an interruption)."""
    run_dir = Path(recipe.job.run_dir)
    tokenizer = load_tokenizer(recipe.data.tokenizer or recipe.model.pretrained)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    renderer = stage_renderer(recipe, tokenizer, arch)
    sequences = load_sft_sequences(recipe.data, renderer)
    stream = SFTStream(len(sequences), recipe.sft.global_batch, recipe.job.seed, recipe.data.shuffle)
    total = recipe.sft.max_steps or recipe.sft.epochs * stream.steps_per_epoch
    dp_size = recipe.data_parallel_size(world_size)
    dp_rank = rank // recipe.parallel.tp

    model = build_policy(recipe, arch, world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, recipe.optimizer)
    scheduler = build_scheduler(optimizer, total, recipe.scheduler)
    ckpt_root = run_dir / "checkpoints"
    state = resume_state(ckpt_root, model, optimizer, scheduler, stream, resume=recipe.checkpoint.resume)
    step = resumed = state.get("step", 0)
    resumption = resume_records(recipe, rank, state, total)  # cuts the dead attempt's records; says so
    metrics = stage_metrics(recipe, rank)
    peak = resolve_peak_tflops(recipe.metrics.peak_tflops, device_name())
    train_vision = not recipe.model.freeze_vision

    def save(at: int) -> None:
        save_checkpoint(ckpt_root, at, model, optimizer, stage_state(scheduler, stream),
                        keep_last=recipe.checkpoint.keep_last)

    loss_value = resumption.final_loss
    end = total if stop_after is None else min(total, step + stop_after)
    while step < end:
        start = time.perf_counter()
        batches, valid_tokens, padding = rank_microbatches(
            sequences, stream.next_batch(), recipe.data.max_tokens, dp_size, dp_rank, renderer)
        t_data = time.perf_counter()
        model.train()
        loss = torch.zeros(())
        for batch in batches:
            micro = _forward_loss(model, batch, max(valid_tokens, 1), recipe.sft.loss_chunk)
            micro.backward()
            loss += micro.detach()
        t_backward = time.perf_counter()
        grad_norm = clip_grad_norm_(params, recipe.optimizer.grad_clip or float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        t_optimizer = time.perf_counter()
        step += 1
        flops = sum(packed_batch_flops(arch, b, train_vision) for b in batches)
        tokens, flops = _all_sum(torch.tensor([sum(b.num_tokens for b in batches), flops], dtype=torch.float64)).tolist()
        loss_value = float(_all_sum(loss) / max(recipe.parallel.tp, 1))
        elapsed = time.perf_counter() - start
        if step % recipe.metrics.log_every == 0 or step == end:
            record = {"loss": loss_value, "grad_norm": float(grad_norm), "lr": lr, "tokens_per_s": tokens / elapsed,
                      "padding_frac": padding, "valid_tokens": valid_tokens, "step_time_s": elapsed,
                      "epoch": stream.cursor.epoch, "model_tflops": flops / 1e12, "time_data_s": t_data - start,
                      "time_forward_backward_s": t_backward - t_data, "time_optimizer_s": t_optimizer - t_backward,
                      "memory_peak_gib": peak_memory_gib()}
            utilisation = mfu(flops, elapsed, world_size, peak)
            if utilisation is not None:
                record["mfu"] = utilisation
            metrics.log(step, total, record)
        if recipe.checkpoint.every_steps and step % recipe.checkpoint.every_steps == 0:
            save(step)
    finish_stage(save, step, resumed, total, recipe, model, tokenizer, renderer.image_config, run_dir)
    metrics.close()
    return StageResult(steps=step, resumed_from=resumed, final_loss=loss_value, run_dir=run_dir)
