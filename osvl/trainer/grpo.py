"""The GRPO stage: rollouts -> scoring -> fatal-aware advantages -> packing -> fused loss -> optimizer -> sync.

Topology: every data-parallel rank holds an unsharded copy of the policy in its ``LocalEngine`` and
rolls out its own strided share of the step's prompts (whole groups) against its own tool pool;
the scored trajectories are then all-gathered, so advantages, statistics and the packing plan are
computed over the whole step on every rank and each rank trains on its token-balanced slice.
After the step's optimizer updates, the FSDP2 shards are gathered into every engine
(policy version = optimizer steps taken). An SGLang engine would take the same weights by URL.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from osvl_kernels import linear_grpo_loss
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torchtitan.distributed.utils import clip_grad_norm_

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.distributed import global_normalizers
from osvl.data.tokenizer import load_tokenizer
from osvl.model import build_model
from osvl.rl.advantages import AdvantageConfig, trajectory_advantages
from osvl.rl.rewards import score_batch
from osvl.rl.stats import batch_stats
from osvl.rl.trajectory import Trajectory
from osvl.rollout import (
    Engine,
    LocalEngine,
    RolloutMetrics,
    RolloutRecorder,
    derive_seed,
    stream_groups,
)
from osvl.tools import ToolEnvironment
from osvl.trainer.checkpoint import (
    finish_stage,
    resume_state,
    save_checkpoint,
    stage_state,
)
from osvl.trainer.flops import (
    device_name,
    generation_flops,
    mfu,
    packed_batch_flops,
    resolve_peak_tflops,
    trajectory_turns,
)
from osvl.trainer.grpo_data import (
    load_prompts,
    rank_minibatch,
    rank_share,
    reward_scoring,
    rollout_configs,
    training_sequences,
)
from osvl.trainer.metrics import peak_memory_gib, stage_metrics
from osvl.trainer.optim import build_optimizer, build_scheduler
from osvl.trainer.policy import build_policy, lm_head_weight, policy_arch
from osvl.trainer.resume import resume_records
from osvl.trainer.sft import StageResult
from osvl.trainer.sft_data import SFTStream
from osvl.trainer.tool_env import (
    EnvironmentFactory,
    FaultInjectingRunner,
    stage_renderer,
    world_environment,
)

EngineWrapper = Callable[[LocalEngine], Engine]  # tests script the policy through a ReplayEngine


def check_grpo_recipe(recipe: Recipe, dp_size: int) -> None:
    g = recipe.grpo
    if recipe.judges.accuracy != "exact" or recipe.judges.query != "heuristic":
        raise ValueError("judges: the grpo stage runs the offline judges (accuracy='exact', query='heuristic'); "
                         "LLM judges are not wired into the trainer yet")
    if recipe.rollout.engine != "local":
        raise ValueError("rollout.engine: the grpo stage drives the in-process local engine; sglang is not wired yet")
    if g.kl_coef:
        raise ValueError("grpo.kl_coef > 0 needs a reference policy, which the grpo stage does not keep (the paper "
                         "uses no KL loss)")
    if g.mini_batch_prompts % dp_size:
        raise ValueError(f"grpo.mini_batch_prompts {g.mini_batch_prompts} must be a multiple of the "
                         f"data-parallel size {dp_size}")


def _rollout(prompts, engine: Engine, env, renderer: ChatRenderer, recipe: Recipe, step: int) -> tuple[list[Trajectory], RolloutMetrics]:
    """This rank's groups; group ids are the prompts' positions in the step's global batch."""
    agent, workers = rollout_configs(recipe)
    metrics = RolloutMetrics()
    group_ids = [gid for gid, _ in prompts]

    async def collect() -> list[Trajectory]:
        out = []
        async for group in stream_groups([p for _, p in prompts], engine, env, renderer, agent, workers,
                                         step=step, metrics=metrics):
            out += [dataclasses.replace(t, group_id=group_ids[group.group_id]) for t in group.trajectories]
        return out

    return asyncio.run(collect()), metrics


def _gather(trajectories: list[Trajectory]) -> list[Trajectory]:
    if dist.is_initialized():
        parts: list[list[Trajectory]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, trajectories)
        trajectories = [t for part in parts for t in part]
    return sorted(trajectories, key=lambda t: (t.group_id, t.sample_index))


def _sum(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def step_faults(env: ToolEnvironment, seed: int, step: int, rank: int) -> ToolEnvironment:
    """Faults seeded by (job seed, step, rank): with each call's identity (group, sample, turn) that
    fixes every fault decision, so a resumed run injects the same faults without checkpointing the
    injector, and concurrent rollouts inject them whatever order the calls finish in."""
    if not isinstance(env.pool, FaultInjectingRunner):
        return env
    stepped = copy.copy(env)  # keeps the environment's class (a tool profile translates calls)
    stepped.pool = FaultInjectingRunner(env.pool.runner, env.pool.rate,
                                        seed=derive_seed(step, f"tool-faults/{rank}", 0, seed))
    return stepped


def _rollout_flops(trajectories: list[Trajectory], renderer: ChatRenderer, arch) -> float:
    """Engine FLOPs of this rank's rollouts (text decoder; the engine re-prefills every turn)."""
    turns = []
    for t in trajectories:
        prompt_tokens = len(renderer.render_prompt(t.prompt).ids)
        turns += trajectory_turns(prompt_tokens, [(len(s.token_ids), len(s.observation_token_ids)) for s in t.steps])
    return generation_flops(arch.text, turns)


def sync_weights(model, engine: LocalEngine, version: int) -> None:
    """Collective: gathers the full (unsharded) weights on every rank into its engine."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    engine.load_weights({k: v.detach() for k, v in full.items()}, version)


def run_grpo(recipe: Recipe, rank: int = 0, world_size: int = 1, stop_after: int | None = None, *,
             environment: EnvironmentFactory = world_environment,
             engine_wrapper: EngineWrapper | None = None) -> StageResult:
    """Train to ``grpo.max_steps`` rollout steps (or ``stop_after`` of them, to simulate an interruption)."""
    g = recipe.grpo
    dp_size, dp_rank = recipe.data_parallel_size(world_size), rank // recipe.parallel.tp
    check_grpo_recipe(recipe, dp_size)
    run_dir = Path(recipe.job.run_dir)
    tokenizer = load_tokenizer(recipe.data.tokenizer or recipe.model.pretrained)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    renderer = stage_renderer(recipe, tokenizer, arch)  # as in SFT: the policy learned this prompt
    prompts = load_prompts(recipe.data)
    if g.batch_prompts > len(prompts):
        raise ValueError(f"grpo.batch_prompts {g.batch_prompts} exceeds the {len(prompts)} RL prompts")
    stream = SFTStream(len(prompts), g.batch_prompts, recipe.job.seed, recipe.data.shuffle)
    total = g.max_steps or g.epochs * stream.steps_per_epoch
    minis = g.batch_prompts // g.mini_batch_prompts

    model = build_policy(recipe, arch, world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, recipe.optimizer)
    scheduler = build_scheduler(optimizer, total * minis, recipe.scheduler)
    local = LocalEngine(build_model(arch, init=False), tokenizer, renderer.image_config,
                        max_batch=recipe.rollout.max_in_flight, deterministic=recipe.rollout.deterministic)
    engine = engine_wrapper(local) if engine_wrapper else local
    ckpt_root = run_dir / "checkpoints"
    state = resume_state(ckpt_root, model, optimizer, scheduler, stream, resume=recipe.checkpoint.resume)
    step = resumed = state.get("step", 0)
    version = state["policy_version"] if state else 0  # optimizer steps taken: the engines' weight version
    resumption = resume_records(recipe, rank, state, total)  # cuts the dead attempt's records; says so
    sync_weights(model, local, version)
    metrics = stage_metrics(recipe, rank)
    recorder = RolloutRecorder(run_dir / "rollouts")
    scoring = reward_scoring(recipe)
    advantage_config = AdvantageConfig(mode=g.fatal_mode, estimator=g.estimator)
    peak = resolve_peak_tflops(recipe.metrics.peak_tflops, device_name())
    train_vision = not recipe.model.freeze_vision

    def save(at: int) -> None:
        save_checkpoint(ckpt_root, at, model, optimizer, stage_state(scheduler, stream, policy_version=version),
                        keep_last=recipe.checkpoint.keep_last)

    final_loss = resumption.final_loss
    end = total if stop_after is None else min(total, step + stop_after)
    with environment(recipe, rank) as env:
        while step < end:
            t0 = time.perf_counter()
            batch = stream.next_batch()
            mine = [(gid, prompts[i]) for gid, i in rank_share(batch, dp_size, dp_rank)]
            local.model.eval()
            rolled, rollout_metrics = _rollout(mine, engine, step_faults(env, recipe.job.seed, step, rank), renderer,
                                               recipe, step)
            t1 = time.perf_counter()
            scored = _gather(score_batch(rolled, *scoring))
            advantages = trajectory_advantages(scored, advantage_config)
            stats = batch_stats(advantages, scored)
            sequences = training_sequences(scored, advantages, renderer)
            t2 = time.perf_counter()

            model.train()
            totals = dict.fromkeys(("loss", "tokens", "valid", "valid_first", "clip", "entropy", "kl_old",
                                    "lp_diff", "grad_norm", "train_flops", "rollout_flops"), 0.0)
            totals["rollout_flops"] = _rollout_flops(rolled, renderer, arch)
            padding = []
            for m in range(minis):
                members = [s for s in sequences if s.group_id // g.mini_batch_prompts == m]
                batches, pad = rank_minibatch(members, recipe.data.max_tokens, dp_size, dp_rank, renderer)
                padding.append(pad)
                norms = global_normalizers(batches)
                for b in batches:
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
                    totals["train_flops"] += packed_batch_flops(arch, b, train_vision)
                    n = out.metrics["num_valid_tokens"].double()
                    delta = (out.logprobs - b.old_logprobs)[out.logprobs != 0]  # approx. KL(behaviour || policy)
                    totals["loss"] += float(out.loss.detach())
                    totals["tokens"] += b.num_tokens
                    totals["valid"] += float(n)
                    totals["clip"] += float(out.metrics["clip_frac"] * n)
                    totals["entropy"] += float(out.metrics["entropy_mean"] * n)
                    if m == 0:  # the first mini-batch runs on the weights that generated the rollouts
                        totals["lp_diff"] += float(out.metrics["logprob_abs_diff_mean"] * n)
                        totals["valid_first"] += float(n)
                    totals["kl_old"] += float((torch.expm1(delta) - delta).sum()) if delta.numel() else 0.0
                totals["grad_norm"] += float(clip_grad_norm_(params, recipe.optimizer.grad_clip or float("inf")))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                version += 1
            t3 = time.perf_counter()
            sync_weights(model, local, version)
            t4 = time.perf_counter()
            step += 1

            keys = list(totals)
            summed = dict(zip(keys, _sum([totals[k] for k in keys])))
            tool_s = _sum([sum(s.tool_result.elapsed_s for t in rolled for s in t.steps if s.tool_result)])[0]
            valid = max(summed["valid"], 1.0)
            parts = [t.reward for t in scored if t.reward is not None and t.reward.scored]
            if rank == 0:
                recorder.write(step, scored)
            record = {
                "loss": summed["loss"] / max(recipe.parallel.tp, 1), "grad_norm": totals["grad_norm"] / minis,
                "lr": scheduler.get_last_lr()[0], "policy_version": version,
                "reward": _mean(p.total for p in parts), "reward_fmt": _mean(p.fmt for p in parts),
                "reward_acc": _mean(p.acc for p in parts), "reward_query": _mean(p.query for p in parts),
                "accuracy": _mean(p.acc for p in parts),
                "fatal_rate": stats.fatal_fraction or 0.0, "clamped_frac": stats.clamped_fraction or 0.0,
                "fatal": stats.fatal, "clamped": stats.clamped, "dropped": stats.infra_dropped + stats.unscored + stats.hard_masked,
                "clip_frac": summed["clip"] / valid, "entropy": summed["entropy"] / valid, "kl": summed["kl_old"] / valid,
                "logprob_abs_diff": summed["lp_diff"] / max(summed["valid_first"], 1.0), "train_tokens": summed["valid"],
                "tokens_per_s": summed["tokens"] / max(t3 - t2, 1e-9), "padding_frac": _mean(padding),
                "turns_mean": rollout_metrics.summary()["turns_mean"],
                "time_rollout_s": t1 - t0, "time_tools_s": tool_s, "time_scoring_s": t2 - t1,
                "time_train_s": t3 - t2, "time_sync_s": t4 - t3, "step_time_s": t4 - t0,
                "memory_peak_gib": peak_memory_gib(),
                "model_tflops": summed["train_flops"] / 1e12, "rollout_tflops": summed["rollout_flops"] / 1e12,
            }
            utilisation = mfu(summed["train_flops"] + summed["rollout_flops"], t4 - t0, world_size, peak)
            if utilisation is not None:
                record["mfu"] = utilisation
            final_loss = record["loss"]
            if step % recipe.metrics.log_every == 0 or step == end:
                metrics.log(step, total, record)
            if recipe.checkpoint.every_steps and step % recipe.checkpoint.every_steps == 0:
                save(step)
    finish_stage(save, step, resumed, total, recipe, model, tokenizer, renderer.image_config, run_dir)
    metrics.close()
    return StageResult(steps=step, resumed_from=resumed, final_loss=final_loss, run_dir=run_dir)
