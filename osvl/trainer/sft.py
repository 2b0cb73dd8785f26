"""The SFT stage (paper Eq. 8): masked next-token loss on the policy's tokens of expert trajectories."""

from __future__ import annotations

import time

import torch

from osvl.config.recipe import Recipe
from osvl.step import optim_step, sft_forward_loss
from osvl.trainer.flops import mfu, packed_batch_flops
from osvl.trainer.metrics import peak_memory_gib
from osvl.trainer.router_losses import RouterLosses
from osvl.trainer.sft_data import load_sft_sequences, rank_microbatches
from osvl.trainer.stage import StageResult, all_reduce_sums, stage_inputs, start_stage


def run_sft(recipe: Recipe, rank: int = 0, world_size: int = 1, stop_after: int | None = None) -> StageResult:
    """Train to the recipe's step count (or ``stop_after`` steps, to simulate an interruption)."""
    tokenizer, arch, renderer = stage_inputs(recipe)
    sequences = load_sft_sequences(recipe.data, renderer)
    if recipe.sft.global_batch > len(sequences):
        raise ValueError(
            f"sft.global_batch {recipe.sft.global_batch} exceeds the {len(sequences)} training trajectories"
        )
    stage = start_stage(
        recipe,
        rank,
        world_size,
        arch,
        num_items=len(sequences),
        batch_size=recipe.sft.global_batch,
        max_steps=recipe.sft.max_steps,
        epochs=recipe.sft.epochs,
    )
    model, stream = stage.model, stage.stream
    router_losses = RouterLosses(model, recipe.moe, recipe.parallel.tp)
    train_vision = not recipe.model.freeze_vision
    loss_value = stage.resumption.final_loss  # recorded at the resumed step; nan when fresh
    end = stage.total if stop_after is None else min(stage.total, stage.step + stop_after)
    skipped = 0  # non-finite updates dropped since the last logged step
    stage.restore_rng()
    while stage.step < end:
        start = time.perf_counter()
        batches, valid_tokens, padding = rank_microbatches(
            sequences, stream.next_batch(), recipe.data.max_tokens, stage.dp_size, stage.dp_rank, renderer
        )
        t_data = time.perf_counter()
        model.train()
        loss = torch.zeros((), device=next(model.parameters()).device)
        router_losses.start(batches)
        for batch in batches:
            router_losses.prepare(batch)
            micro = sft_forward_loss(model, batch, max(valid_tokens, 1), recipe.sft.loss_chunk)
            micro.backward()
            loss += micro.detach()
        t_backward = time.perf_counter()
        lr = stage.scheduler.get_last_lr()[0]
        update = optim_step(stage.params, stage.optimizer, stage.scheduler, recipe.optimizer)
        skipped += update.skipped
        t_optimizer = time.perf_counter()
        stage.step += 1
        sums = all_reduce_sums(
            {
                "loss": loss,
                "grad_norm": update.grad_norm / world_size,
                "tokens": sum(b.num_tokens for b in batches),
                "flops": sum(packed_batch_flops(arch, b, train_vision) for b in batches),
            }
        )
        loss_value = sums["loss"] / max(recipe.parallel.tp, 1)
        elapsed = time.perf_counter() - start
        if stage.step % recipe.metrics.log_every == 0 or stage.step == end:
            record = {
                "loss": loss_value,
                "grad_norm": sums["grad_norm"],
                "lr": lr,
                "tokens_per_s": sums["tokens"] / elapsed,
                "padding_frac": padding,
                "valid_tokens": valid_tokens,
                "step_time_s": elapsed,
                "epoch": stream.cursor.epoch,
                "model_tflops": sums["flops"] / 1e12,
                "time_data_s": t_data - start,
                "time_forward_backward_s": t_backward - t_data,
                "time_optimizer_s": t_optimizer - t_backward,
                "memory_peak_gib": peak_memory_gib(),
                "nonfinite_skipped": float(skipped),
                **router_losses.metrics(),
            }
            utilisation = mfu(sums["flops"], elapsed, world_size, stage.peak_tflops)
            if utilisation is not None:
                record["mfu"] = utilisation
            stage.metrics.log(stage.step, stage.total, record)
            skipped = 0
        stage.maybe_save()
    return stage.finish(tokenizer, renderer, loss_value)
