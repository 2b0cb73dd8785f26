"""The GRPO stage: rollouts -> scoring -> fatal-aware advantages -> packing -> fused loss -> optimizer -> sync.

Topology: each data-parallel rank rolls out its strided share of the step's prompts (whole
groups) through the rollout engine (an SGLang fleet, or the CPU form's in-process engine; see
``osvl.trainer.serving``) and its tools (local workers or tool servers), and judges each group as
soon as it completes. The scored trajectories are all-gathered, so advantages, statistics and
the packing plan are computed over the whole step on every rank, and each rank trains on its
token-balanced slice. After every optimizer step (policy version = optimizer steps taken) the
weights go to the engines, which must report the new version.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from osvl_kernels import linear_grpo_loss
from torchtitan.distributed.utils import clip_grad_norm_

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.distributed import global_normalizers
from osvl.data.packing import PackedBatch
from osvl.rl.advantages import AdvantageConfig, trajectory_advantages
from osvl.rl.fatal import has_infra_error
from osvl.rl.scoring import GroupScorer, JudgeStats
from osvl.rl.stats import batch_stats
from osvl.rl.trajectory import Prompt, Trajectory
from osvl.rollout import RolloutMetrics, RolloutRecorder, derive_seed, stream_groups
from osvl.tools import ToolEnvironment
from osvl.trainer.flops import generation_flops, mfu, packed_batch_flops, trajectory_turns
from osvl.trainer.grpo_data import (
    load_prompts,
    rank_minibatch,
    rank_share,
    rollout_configs,
    stage_scorer,
    training_sequences,
)
from osvl.trainer.metrics import peak_memory_gib
from osvl.trainer.policy import lm_head_weight
from osvl.trainer.router_losses import RouterLosses
from osvl.trainer.preflight import check_grpo_recipe, preflight
from osvl.trainer.serving import EngineWrapper, Serving, build_serving
from osvl.trainer.stage import Stage, StageResult, all_reduce_sums, stage_inputs, start_stage
from osvl.trainer.tool_env import EnvironmentFactory, FaultInjectingRunner, stage_environment
from osvl.trainer.validation import Validator

__all__ = ["check_grpo_recipe", "run_grpo", "step_faults"]

T = TypeVar("T")


@dataclass
class RolloutBatch:
    """One step's rollouts: this rank's, and the scored ones of every rank (same on all ranks)."""

    mine: list[Trajectory]
    scored: list[Trajectory]
    metrics: RolloutMetrics
    judges: dict[str, float]


def step_faults(env: ToolEnvironment, seed: int, step: int, rank: int) -> ToolEnvironment:
    """Faults seeded by (job seed, step, rank): with each call's identity (group, sample, turn) that
    fixes every fault decision, so a resumed run injects the same faults without checkpointing the
    injector, and concurrent rollouts inject them whatever order the calls finish in."""
    if not isinstance(env.pool, FaultInjectingRunner):
        return env
    stepped = copy.copy(env)  # keeps the environment's class (a tool profile translates calls)
    stepped.pool = FaultInjectingRunner(env.pool.runner, env.pool.rate,
                                        seed=derive_seed(step, f"tool-faults/{rank}", 0, seed), outages=env.pool.outages)
    return stepped


def _all_gather(item: T) -> list[T]:
    if not dist.is_initialized():
        return [item]
    parts: list[T] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, item)
    return parts


def _gather(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Every rank's scored trajectories, in (group, sample) order."""
    return sorted((t for part in _all_gather(trajectories) for t in part), key=lambda t: (t.group_id, t.sample_index))


async def _rollout_and_score(prompts: Sequence[tuple[int, Prompt]], serving: Serving, env: ToolEnvironment,
                             scorer: GroupScorer, renderer: ChatRenderer, recipe: Recipe, step: int,
                             metrics: RolloutMetrics) -> list[Trajectory]:
    """This rank's groups, each judged as soon as it completes (judging overlaps the other rollouts)."""
    agent, workers = rollout_configs(recipe)
    group_ids = [gid for gid, _ in prompts]
    judging = []
    async for group in stream_groups([p for _, p in prompts], serving.engine, env, renderer, agent, workers,
                                     step=step, metrics=metrics):
        trajectories = [dataclasses.replace(t, group_id=group_ids[group.group_id]) for t in group.trajectories]
        judging.append(asyncio.ensure_future(scorer.score_group(trajectories)))
    return [t for scored in await asyncio.gather(*judging) for t in scored]


def rollout_step(stage: Stage, prompts: list[Prompt], serving: Serving, env: ToolEnvironment, scorer: GroupScorer,
                 renderer: ChatRenderer, runner: asyncio.Runner) -> RolloutBatch:
    recipe = stage.recipe
    batch = stage.stream.next_batch()
    mine = [(gid, prompts[i]) for gid, i in rank_share(batch, stage.dp_size, stage.dp_rank)]
    if serving.local is not None:
        serving.local.model.eval()
    metrics = RolloutMetrics()
    faulted = step_faults(env, recipe.job.seed, stage.step, stage.rank)
    scored_mine = runner.run(_rollout_and_score(mine, serving, faulted, scorer, renderer, recipe, stage.step,
                                                metrics))
    scored = _gather(scored_mine)
    return RolloutBatch(scored_mine, scored, metrics, JudgeStats.merge(_all_gather(scorer.stats.take())).metrics(scored))


def train_minibatch(stage: Stage, batches: Sequence[PackedBatch], sums: dict[str, torch.Tensor | float],
                    router_losses: RouterLosses, first: bool) -> None:
    """Forward, fused loss (and the MoE router losses) and backward of this rank's micro-batches of one
    mini-batch, then the optimizer step. Metric sums stay on the device (``sums``)."""
    g, model = stage.recipe.grpo, stage.model
    norms = global_normalizers(batches)
    train_vision = not stage.recipe.model.freeze_vision
    router_losses.start(batches)
    device = next(model.parameters()).device
    for b in batches:
        router_losses.prepare(b)  # reads host-side counts
        b = b.to(device)  # packed on the host; the forward runs where the shards live
        hidden = model(b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids,
                       pixel_values=b.pixel_values, image_grid_thw=b.image_grid_thw, return_hidden=True)
        out = linear_grpo_loss(
            hidden, lm_head_weight(model), b.target_ids, b.cu_seqlens, b.loss_mask,
            old_logprobs=b.old_logprobs, fatal_step=b.fatal_step, token_step=b.token_step,
            advantages=b.advantages, eps_low=g.eps_low, eps_high=g.eps_high, kl_coef=g.kl_coef,
            entropy_coef=g.entropy_coef, temperature=g.temperature, loss_agg=g.loss_agg,
            num_seqs=norms.num_seqs.clamp_min(1), num_tokens=norms.num_valid_tokens.clamp_min(1),
            max_response_len=g.max_response_tokens, chunk_size=g.loss_chunk,
            backend="auto" if hidden.is_cuda else "torch")  # Triton on CPU is the test interpreter
        out.loss.backward()
        n = out.metrics["num_valid_tokens"].double()
        scored = out.logprobs != 0
        delta = torch.where(scored, out.logprobs - b.old_logprobs, 0.0)  # approx. KL(behaviour || policy)
        _add(sums, "loss", out.loss.detach())
        _add(sums, "tokens", b.num_tokens)
        _add(sums, "valid", n)
        _add(sums, "clip", out.metrics["clip_frac"] * n)
        _add(sums, "entropy", out.metrics["entropy_mean"] * n)
        _add(sums, "kl_old", (torch.expm1(delta) - delta).sum())
        _add(sums, "train_flops", packed_batch_flops(stage.model.arch, b, train_vision))
        if first:  # the first mini-batch runs on the weights that generated the rollouts
            _add(sums, "lp_diff", out.metrics["logprob_abs_diff_mean"] * n)
            _add(sums, "valid_first", n)
    grad_norm = clip_grad_norm_(stage.params, stage.recipe.optimizer.grad_clip or float("inf"))
    _add(sums, "grad_norm", grad_norm / stage.world_size)  # the global norm on every rank: sums to it
    stage.optimizer.step()
    stage.scheduler.step()
    stage.optimizer.zero_grad(set_to_none=True)


def _add(sums: dict[str, torch.Tensor | float], key: str, value: torch.Tensor | float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def run_grpo(recipe: Recipe, rank: int = 0, world_size: int = 1, stop_after: int | None = None, *,
             environment: EnvironmentFactory = stage_environment,
             engine_wrapper: EngineWrapper | None = None) -> StageResult:
    """Train to ``grpo.max_steps`` rollout steps (or ``stop_after`` of them, to simulate an interruption)."""
    g = recipe.grpo
    check_grpo_recipe(recipe, recipe.data_parallel_size(world_size))
    tokenizer, arch, renderer = stage_inputs(recipe)  # as in SFT: the policy learned this prompt
    prompts = load_prompts(recipe.data)
    if g.batch_prompts > len(prompts):
        raise ValueError(f"grpo.batch_prompts {g.batch_prompts} exceeds the {len(prompts)} RL prompts")
    minis = g.batch_prompts // g.mini_batch_prompts
    stage = start_stage(recipe, rank, world_size, arch, num_items=len(prompts), batch_size=g.batch_prompts,
                        max_steps=g.max_steps, epochs=g.epochs, updates_per_step=minis)
    version = stage.state.get("policy_version", 0)  # optimizer steps taken: the engines' weight version
    recorder = RolloutRecorder(stage.run_dir / "rollouts")
    router_losses = RouterLosses(stage.model, recipe.moe, recipe.parallel.tp)
    validator = Validator(recipe, renderer, rank, stage.dp_size) if recipe.validation.path else None
    advantage_config = AdvantageConfig(mode=g.fatal_mode, estimator=g.estimator)
    final_loss = float("nan")
    end = stage.total if stop_after is None else min(stage.total, stage.step + stop_after)
    with asyncio.Runner() as runner, environment(recipe, rank) as env:
        serving = build_serving(recipe, arch, tokenizer, renderer.image_config, runner.run, engine_wrapper)
        scorer = stage_scorer(recipe)
        try:
            sync = serving.sync.sync(stage.model, version)  # the engines serve the resumed (or initial) weights
            for line in preflight(recipe, stage.model, serving, env, scorer, renderer, prompts[0], runner):
                if rank == 0:
                    print(f"pre-flight: {line}", flush=True)
            while stage.step < end:
                t0 = time.perf_counter()
                rolled = rollout_step(stage, prompts, serving, env, scorer, renderer, runner)
                t1 = time.perf_counter()
                advantages = trajectory_advantages(rolled.scored, advantage_config)
                stats = batch_stats(advantages, rolled.scored)
                sequences = training_sequences(rolled.scored, advantages, renderer)
                t2 = time.perf_counter()
                stage.model.train()
                sums: dict[str, torch.Tensor | float] = {"rollout_flops": _rollout_flops(rolled.mine, renderer, arch)}
                padding = []
                for m in range(minis):
                    members = [s for s in sequences if s.group_id // g.mini_batch_prompts == m]
                    batches, pad = rank_minibatch(members, recipe.data.max_tokens, stage.dp_size, stage.dp_rank,
                                                  renderer)
                    padding.append(pad)
                    train_minibatch(stage, batches, sums, router_losses, first=m == 0)
                    version += 1
                t3 = time.perf_counter()
                sync = serving.sync.sync(stage.model, version)
                t4 = time.perf_counter()
                stage.step += 1
                sums["tool_s"] = sum(s.tool_result.elapsed_s for t in rolled.mine for s in t.steps if s.tool_result)
                summed = all_reduce_sums(sums)
                if rank == 0:
                    recorder.write(stage.step, rolled.scored)
                record = step_record(stage, summed, rolled, stats, padding, version, sync, (t0, t1, t2, t3, t4))
                record.update(router_losses.metrics())
                final_loss = record["loss"]
                validating = validator is not None and validator.due(stage.step, stage.total)
                if validating:
                    record.update(validator.run(serving.engine, env, runner.run))
                if stage.step % recipe.metrics.log_every == 0 or stage.step == end or validating:
                    stage.metrics.log(stage.step, stage.total, record)
                stage.extra_state = {"policy_version": version}
                stage.maybe_save()
        finally:
            scorer.close()
            serving.close(runner.run)
    stage.extra_state = {"policy_version": version}
    return stage.finish(tokenizer, renderer, final_loss)


def step_record(stage: Stage, summed: dict[str, float], rolled: RolloutBatch, stats, padding: list[float],
                version: int, sync, times: tuple[float, ...]) -> dict[str, float]:
    """The step's metrics line (every value reduced over ranks where it is a sum)."""
    t0, t1, t2, t3, t4 = times
    recipe = stage.recipe
    valid = max(summed.get("valid", 0.0), 1.0)
    parts = [t.reward for t in rolled.scored if t.reward is not None and t.reward.scored]
    minis = recipe.grpo.batch_prompts // recipe.grpo.mini_batch_prompts
    record = {
        "loss": summed.get("loss", 0.0) / max(recipe.parallel.tp, 1), "grad_norm": summed["grad_norm"] / minis,
        "lr": stage.scheduler.get_last_lr()[0], "policy_version": version,
        "reward": _mean(p.total for p in parts), "reward_fmt": _mean(p.fmt for p in parts),
        "reward_acc": _mean(p.acc for p in parts), "reward_query": _mean(p.query for p in parts),
        "accuracy": _mean(p.acc for p in parts),
        "fatal_rate": stats.fatal_fraction or 0.0, "clamped_frac": stats.clamped_fraction or 0.0,
        "fatal": stats.fatal, "clamped": stats.clamped, "preserved": stats.preserved,
        "dropped": stats.infra_dropped + stats.unscored + stats.hard_masked,
        "unscored": stats.unscored, "infra_dropped": stats.infra_dropped, "infra_kept": stats.infra_kept,
        "infra_hit": sum(map(has_infra_error, rolled.scored)),
        "tool_calls_mean": _mean(sum(s.tool_result is not None for s in t.steps) for t in rolled.scored),
        "clip_frac": summed.get("clip", 0.0) / valid, "entropy": summed.get("entropy", 0.0) / valid,
        "kl": summed.get("kl_old", 0.0) / valid,
        "logprob_abs_diff": summed.get("lp_diff", 0.0) / max(summed.get("valid_first", 0.0), 1.0),
        "train_tokens": summed.get("valid", 0.0),
        "tokens_per_s": summed.get("tokens", 0.0) / max(t3 - t2, 1e-9), "padding_frac": _mean(padding),
        "turns_mean": rolled.metrics.summary()["turns_mean"],
        "time_rollout_s": t1 - t0, "time_tools_s": summed["tool_s"], "time_scoring_s": t2 - t1,
        "time_train_s": t3 - t2, "time_sync_s": t4 - t3, "step_time_s": t4 - t0,
        "sync_s": sync.seconds, "sync_bytes": float(sync.bytes),
        "memory_peak_gib": peak_memory_gib(),
        "model_tflops": summed.get("train_flops", 0.0) / 1e12, "rollout_tflops": summed["rollout_flops"] / 1e12,
        **rolled.judges,
    }
    for key in ("mean_pre_clamp_zeroed", "mean_pre_clamp_preserved"):
        if getattr(stats, key) is not None:
            record[key] = getattr(stats, key)
    utilisation = mfu(summed.get("train_flops", 0.0) + summed["rollout_flops"], t4 - t0, stage.world_size,
                      stage.peak_tflops)
    if utilisation is not None:
        record["mfu"] = utilisation
    return record


def _rollout_flops(trajectories: list[Trajectory], renderer: ChatRenderer, arch) -> float:
    """Engine FLOPs of this rank's rollouts (text decoder; the engine re-prefills every turn)."""
    turns = []
    for t in trajectories:
        prompt_tokens = len(renderer.render_prompt(t.prompt).ids)
        turns += trajectory_turns(prompt_tokens, [(len(s.token_ids), len(s.observation_token_ids)) for s in t.steps])
    return generation_flops(arch.text, turns)
