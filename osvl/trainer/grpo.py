"""The GRPO stage: rollouts -> scoring -> fatal-aware advantages -> packing -> fused loss -> optimizer -> sync.

Topology: each data-parallel rank rolls out its strided share of the prompt stream (whole groups)
through the rollout engine (an SGLang fleet, or the CPU form's in-process engine; see
``osvl.serve.engines``) and its tools (local workers or tool servers), on its rollout generator
(``osvl.trainer.rollouts``), which runs on an event-loop thread while the rank trains and judges
each group as soon as it completes. ``rollout.max_staleness = 0`` rolls a step's groups out on the
weights it trains from (the synchronous step); ``N >= 1`` rolls the next steps' groups out while
the rank trains, into a bounded replay buffer, and a step trains on the oldest groups within N
weight syncs (``osvl.rollout.generator``). The step's groups are all-gathered, so advantages,
statistics and the packing plan are computed over the whole step on every rank, and each rank
trains on its token-balanced slice. With ``grpo.old_logprobs = "trainer"`` the old policy's
log-probs are recomputed before the first update, and ``grpo.rollout_correction`` weighs each token
by the trainer/engine ratio (``osvl.trainer.correction``). After the step's optimizer steps (policy
version = optimizer steps taken) the weights go to the engines, which must report the new version.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torchtitan.distributed.utils import clip_grad_norm_

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.distributed import global_normalizers
from osvl.data.packing import PackedBatch
from osvl.parallel import lm_head_weight
from osvl.rl.advantages import AdvantageConfig, trajectory_advantages
from osvl.rl.fatal import has_infra_error
from osvl.rl.scoring import GroupScorer, JudgeStats
from osvl.rl.stats import batch_stats, group_signal
from osvl.rl.trajectory import ToolResult, Trajectory
from osvl.rollout import RolloutRecorder, SGLangEngine
from osvl.rollout.event_loop import EventLoopThread
from osvl.rollout.generator import GeneratorFailed, GeneratorStats, GroupsOverdue, RolloutGenerator
from osvl.rollout.replay import ScoredGroup, staleness_metrics
from osvl.serve.engines import EngineWrapper, Serving, build_serving
from osvl.serve.preflight import preflight
from osvl.tools.fleet import ToolServerFleet, tool_fleet
from osvl.trainer.correction import mismatch_metrics, mismatch_sums, old_policy_logprobs, rollout_correction
from osvl.trainer.flops import generation_flops, mfu, packed_batch_flops, packed_forward_flops, trajectory_turns
from osvl.trainer.grpo_data import load_prompts, rank_minibatch, stage_scorer, training_sequences
from osvl.trainer.metrics import peak_memory_gib
from osvl.trainer.rollouts import GroupRoller, stage_generator
from osvl.trainer.router_losses import RouterLosses
from osvl.trainer.stage import Stage, StageResult, all_reduce_max, all_reduce_sums, stage_inputs, start_stage
from osvl.trainer.tool_env import EnvironmentFactory, stage_environment
from osvl.trainer.validation import Validator, answer_is_grounded
from osvl.trainer.watchdog import WAIT_REPORT_S, Overdue, RunStopped, StepOverdue, step_deadline_s, stop_message
from osvl_kernels import RolloutCorrection, linear_grpo_loss

__all__ = ["run_grpo"]

T = TypeVar("T")


@dataclass
class RolloutBatch:
    """One step's groups: this rank's, and every rank's (the same on all ranks), with what it cost."""

    mine: list[Trajectory]
    groups: list[ScoredGroup]  # every rank's, in ticket order
    scored: list[Trajectory]  # their trajectories, group ids = the group's position in the step
    generated: list[GeneratorStats]  # each rank's generator since the last step
    judges: dict[str, float]


def _all_gather(item: T) -> list[T]:
    if not dist.is_initialized():
        return [item]
    parts: list[T] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, item)
    return parts


def rollout_step(
    generator: RolloutGenerator,
    scorer: GroupScorer,
    deadline_s: float,
    services: Callable[[], str],
    report_every_s: float = WAIT_REPORT_S,
) -> RolloutBatch:
    """This rank's groups of the step (as soon as the generator has them), then every rank's. A rank that
    waits past ``deadline_s``, or whose generator failed, brings what it waited for (and ``services()``,
    their last answers) instead, and the all-gather tells every rank at once: :class:`StepOverdue` on all
    of them, none left waiting for the others. Until then a long wait prints its report every
    ``report_every_s`` seconds."""
    rank = dist.get_rank() if dist.is_initialized() else 0

    def still_waiting(report: str) -> None:
        print(
            f"rank {rank}: still waiting for the step's groups ({deadline_s:.0f} s allowed): {report}; {services()}",
            flush=True,
        )

    try:
        mine, late = generator.next_batch(deadline_s, still_waiting, report_every_s), None
    except (GroupsOverdue, GeneratorFailed) as missing:
        mine, late = [], f"{missing}; {services()}"
    parts = _all_gather((mine, late, generator.take_stats(), scorer.take_stats()))
    overdue = [Overdue(rank, report) for rank, (_, report, _, _) in enumerate(parts) if report is not None]
    if overdue:
        raise StepOverdue(overdue)
    groups = sorted((g for part, _, _, _ in parts for g in part), key=lambda g: g.ticket)
    scored = [dataclasses.replace(t, group_id=i) for i, g in enumerate(groups) for t in g.trajectories]
    judges = JudgeStats.merge([judged for _, _, _, judged in parts]).metrics(scored)
    generated = [s for _, _, s, _ in parts]
    return RolloutBatch([t for g in mine for t in g.trajectories], groups, scored, generated, judges)


def old_policy(
    stage: Stage,
    minibatches: Sequence[Sequence[PackedBatch]],
    router_losses: RouterLosses,
    sums: dict[str, torch.Tensor | float],
) -> list[list[torch.Tensor]]:
    """The trainer's log-probs of every micro-batch on the weights before the step's first update
    (``grpo.old_logprobs = "trainer"``), and the histogram of their distance to the engine's."""
    g = stage.recipe.grpo
    router_losses.idle()
    out = []
    for batches in minibatches:
        logprobs = old_policy_logprobs(stage.model, batches, g.temperature, g.loss_chunk)
        for b, lp in zip(batches, logprobs):
            for key, value in mismatch_sums(lp, b.old_logprobs.to(lp.device), b.loss_mask.to(lp.device)).items():
                _add(sums, key, value)
            _add(sums, "train_flops", packed_forward_flops(stage.model.arch, b))
        out.append(logprobs)
    return out


def train_minibatch(
    stage: Stage,
    batches: Sequence[PackedBatch],
    sums: dict[str, torch.Tensor | float],
    router_losses: RouterLosses,
    first: bool,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    correction: RolloutCorrection | None = None,
) -> None:
    """Forward, fused loss (and the MoE router losses) and backward of this rank's micro-batches of one
    mini-batch, then the optimizer step. The PPO ratio is taken against ``old_logprobs`` (the trainer's)
    when given, else against the engine's; ``correction`` weighs tokens by exp(trainer - engine).
    Metric sums stay on the device (``sums``)."""
    g, model = stage.recipe.grpo, stage.model
    norms = global_normalizers(batches)
    train_vision = not stage.recipe.model.freeze_vision
    router_losses.start(batches)
    device = next(model.parameters()).device
    for i, b in enumerate(batches):
        router_losses.prepare(b)  # reads host-side counts
        b = b.to(device)  # packed on the host; the forward runs where the shards live
        old = b.old_logprobs if old_logprobs is None else old_logprobs[i].to(device)
        hidden = model(
            b.input_ids,
            cu_seqlens=b.cu_seqlens,
            position_ids=b.position_ids,
            pixel_values=b.pixel_values,
            image_grid_thw=b.image_grid_thw,
            return_hidden=True,
        )
        out = linear_grpo_loss(
            hidden,
            lm_head_weight(model),
            b.target_ids,
            b.cu_seqlens,
            b.loss_mask,
            old_logprobs=old,
            behavior_logprobs=None if correction is None else b.old_logprobs,
            rollout_correction=correction,
            fatal_step=b.fatal_step,
            token_step=b.token_step,
            advantages=b.advantages,
            eps_low=g.eps_low,
            eps_high=g.eps_high,
            kl_coef=g.kl_coef,
            entropy_coef=g.entropy_coef,
            temperature=g.temperature,
            loss_agg=g.loss_agg,
            num_seqs=norms.num_seqs.clamp_min(1),
            num_tokens=norms.num_valid_tokens.clamp_min(1),
            max_response_len=g.max_response_tokens,
            chunk_size=g.loss_chunk,
            backend="auto" if hidden.is_cuda else "torch",
        )  # Triton on CPU is the test interpreter
        out.loss.backward()
        n = out.metrics["num_valid_tokens"].double()
        scored = out.logprobs != 0
        delta = torch.where(scored, out.logprobs - old, 0.0)  # approx. KL(old || policy)
        _add(sums, "loss", out.loss.detach())
        _add(sums, "tokens", b.num_tokens)
        _add(sums, "valid", n)
        _add(sums, "clip", out.metrics["clip_frac"] * n)
        _add(sums, "entropy", out.metrics["entropy_mean"] * n)
        _add(sums, "kl_old", (torch.expm1(delta) - delta).sum())
        _add(sums, "is_weight", out.metrics["is_weight_mean"] * n)
        _add(sums, "is_capped", out.metrics["is_capped_frac"] * n)
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


def run_grpo(
    recipe: Recipe,
    rank: int = 0,
    world_size: int = 1,
    stop_after: int | None = None,
    *,
    environment: EnvironmentFactory = stage_environment,
    engine_wrapper: EngineWrapper | None = None,
) -> StageResult:
    """Train to ``grpo.max_steps`` rollout steps (or ``stop_after`` of them, to simulate an interruption)."""
    g = recipe.grpo
    recipe.check_stage(recipe.data_parallel_size(world_size))
    tokenizer, arch, renderer = stage_inputs(recipe)  # as in SFT: the policy learned this prompt
    prompts = load_prompts(recipe.data)
    if g.batch_prompts > len(prompts):
        raise ValueError(f"grpo.batch_prompts {g.batch_prompts} exceeds the {len(prompts)} RL prompts")
    minis = g.batch_prompts // g.mini_batch_prompts
    stage = start_stage(
        recipe,
        rank,
        world_size,
        arch,
        num_items=len(prompts),
        batch_size=g.batch_prompts,
        max_steps=g.max_steps,
        epochs=g.epochs,
        updates_per_step=minis,
    )
    version = stage.state.get("policy_version", 0)  # optimizer steps taken: the engines' weight version
    recorder = RolloutRecorder(stage.run_dir / "rollouts")
    stale_recorder = RolloutRecorder(stage.run_dir / "rollouts" / "stale")  # groups dropped past the bound
    router_losses = RouterLosses(stage.model, recipe.moe, recipe.parallel.tp)
    validator = Validator(recipe, renderer, rank, stage.dp_size) if recipe.validation.path else None
    advantage_config = AdvantageConfig(mode=g.fatal_mode, estimator=g.estimator)
    correction = rollout_correction(g)
    final_loss = stage.resumption.final_loss  # recorded at the resumed step; nan when fresh
    end = stage.total if stop_after is None else min(stage.total, stage.step + stop_after)
    stage.extra_state = {"policy_version": version, "replay": stage.state.get("replay")}
    with EventLoopThread() as loop, environment(recipe, rank) as env:
        serving = build_serving(recipe, arch, tokenizer, renderer.image_config, loop.run, engine_wrapper)
        scorer = stage_scorer(recipe)
        roller = GroupRoller(recipe, prompts, serving, env, scorer, renderer, rank)
        generator = stage_generator(
            recipe, roller, loop, stage.stream, stage.dp_size, stage.dp_rank, version, stage.state.get("replay")
        )
        fleet = tool_fleet(env)
        deadline = step_deadline_s(recipe, stage.dp_size)
        services = functools.partial(service_states, serving, fleet, scorer)
        try:
            sync = serving.sync.sync(stage.model, version)  # the engines serve the resumed (or initial) weights
            for line in preflight(recipe, stage.model, serving, env, scorer, renderer, prompts[0], loop):
                if rank == 0:
                    print(f"pre-flight: {line}", flush=True)
            stage.restore_rng()
            generator.start()
            while stage.step < end:
                t0 = time.perf_counter()
                try:
                    rolled = rollout_step(generator, scorer, deadline, services)
                except StepOverdue as late:
                    raise RunStopped(stop_together(stage, late.ranks)) from None
                t1 = time.perf_counter()
                advantages = trajectory_advantages(rolled.scored, advantage_config)
                stats = batch_stats(advantages, rolled.scored)
                sequences = training_sequences(rolled.scored, advantages, renderer)
                minibatches, padding = zip(
                    *[
                        rank_minibatch(
                            [s for s in sequences if s.group_id // g.mini_batch_prompts == m],
                            recipe.data.max_tokens,
                            stage.dp_size,
                            stage.dp_rank,
                            renderer,
                        )
                        for m in range(minis)
                    ]
                )
                t2 = time.perf_counter()
                sums: dict[str, torch.Tensor | float] = {"rollout_flops": _rollout_flops(rolled.mine, renderer, arch)}
                old = old_policy(stage, minibatches, router_losses, sums) if g.old_logprobs == "trainer" else None
                stage.model.train()
                for m, batches in enumerate(minibatches):
                    train_minibatch(
                        stage,
                        batches,
                        sums,
                        router_losses,
                        first=m == 0,
                        old_logprobs=None if old is None else old[m],
                        correction=correction,
                    )
                    version += 1
                t3 = time.perf_counter()
                sync = generator.update_weights(functools.partial(serving.sync.sync, stage.model, version), version)
                t4 = time.perf_counter()
                stage.step += 1
                sums["tool_s"] = sum(s.tool_result.elapsed_s for t in rolled.mine for s in t.steps if s.tool_result)
                sums["restarts"] = loop.run(roller.take_restarts())
                summed = all_reduce_sums(sums)
                if rank == 0:
                    recorder.write(stage.step, rolled.scored)
                    dropped = [t for s in rolled.generated for group in s.dropped for t in group.trajectories]
                    if dropped:
                        stale_recorder.write(stage.step, dropped)
                record = step_record(stage, summed, rolled, stats, list(padding), version, sync, (t0, t1, t2, t3, t4))
                record.update(router_losses.metrics())
                record.update(service_restarts(serving, fleet, loop))
                final_loss = record["loss"]
                validating = validator is not None and validator.due(stage.step, stage.total)
                if validating:
                    record.update(validator.run(serving.engine, env, loop.run))
                if stage.step % recipe.metrics.log_every == 0 or stage.step == end or validating:
                    stage.metrics.log(stage.step, stage.total, record)
                stage.extra_state = {"policy_version": version, "replay": generator.state_dict()}
                stage.maybe_save()
        finally:
            generator.close()
            scorer.close()
            serving.close(loop.run)
    return stage.finish(tokenizer, renderer, final_loss)


def service_states(serving: Serving, fleet: ToolServerFleet | None, scorer: GroupScorer) -> str:
    """What the services last answered, for a rank that waited too long."""
    tools = f"tool servers: {fleet.health()}" if fleet is not None else "tools: local workers"
    return f"engine: {type(serving.engine).__name__}; {tools}; judges: {scorer.describe()}"


def stop_together(stage: Stage, late: list[Overdue]) -> str:
    """Every rank, after a step whose rollouts did not arrive in time: what each waited for (logged), the
    checkpoint of the last finished step unless one exists (collective: every rank is here), the line."""
    for o in late:
        print(f"rank {stage.rank}: rank {o.rank} waited too long for step {stage.step + 1}: {o.report}", flush=True)
    every = stage.recipe.checkpoint.every_steps
    if stage.step > stage.resumed and not (every and stage.step % every == 0):
        stage.save(stage.step)
        saved = f"checkpoint of step {stage.step} written: relaunch to resume"
    else:
        saved = f"the checkpoint of step {stage.step} was already written: relaunch to resume"
    return stop_message(stage.step + 1, late, saved)


def service_restarts(serving: Serving, fleet: ToolServerFleet | None, loop: EventLoopThread) -> dict[str, float]:
    """The step's restarts of services as the trainer saw them (the largest count over ranks: every rank
    may see the same restart): tool servers that came back as a new process, engine servers that went
    away and came back (given the trainer's weights again when they had lost them)."""
    engine = serving.engine
    return all_reduce_max(
        {
            "tool_server_restarts": fleet.take_restarts() if fleet is not None else 0,
            "engine_restarts": loop.run(engine.take_restarts()) if isinstance(engine, SGLangEngine) else 0,
        }
    )


def step_record(
    stage: Stage,
    summed: dict[str, float],
    rolled: RolloutBatch,
    stats,
    padding: list[float],
    version: int,
    sync,
    times: tuple[float, ...],
) -> dict[str, float]:
    """The step's metrics line (every value reduced over ranks where it is a sum). ``version`` is the
    policy version after the step's updates; the step trained from ``version - updates``."""
    t0, t1, t2, t3, t4 = times
    recipe = stage.recipe
    valid = max(summed.get("valid", 0.0), 1.0)
    parts = [t.reward for t in rolled.scored if t.reward is not None and t.reward.scored]
    minis = recipe.grpo.batch_prompts // recipe.grpo.mini_batch_prompts
    generated = rolled.generated
    ranks = len(generated)
    record = {
        "loss": summed.get("loss", 0.0) / max(recipe.parallel.tp, 1),
        "grad_norm": summed["grad_norm"] / minis,
        "lr": stage.scheduler.get_last_lr()[0],
        "policy_version": version,
        "reward": _mean(p.total for p in parts),
        "reward_fmt": _mean(p.fmt for p in parts),
        "reward_acc": _mean(p.acc for p in parts),
        "reward_query": _mean(p.query for p in parts),
        "accuracy": _mean(p.acc for p in parts),
        "grounded": _mean(map(answer_is_grounded, rolled.scored)),  # answers read from a tool, right or wrong
        **group_signal(rolled.scored).as_metrics(),
        "fatal_rate": stats.fatal_fraction or 0.0,
        "clamped_frac": stats.clamped_fraction or 0.0,
        "fatal": stats.fatal,
        "clamped": stats.clamped,
        "preserved": stats.preserved,
        "dropped": stats.infra_dropped + stats.unscored + stats.hard_masked,
        "unscored": stats.unscored,
        "infra_dropped": stats.infra_dropped,
        "infra_kept": stats.infra_kept,
        "infra_hit": sum(map(has_infra_error, rolled.scored)),
        "tool_calls_mean": _mean(sum(s.tool_result is not None for s in t.steps) for t in rolled.scored),
        "tool_calls_overloaded": sum(r.overloads > 0 for r in _tool_results(rolled.scored)),
        "tool_overload_failures": sum(r.overloaded for r in _tool_results(rolled.scored)),
        "clip_frac": summed.get("clip", 0.0) / valid,
        "entropy": summed.get("entropy", 0.0) / valid,
        "kl": summed.get("kl_old", 0.0) / valid,
        "logprob_abs_diff": summed.get("lp_diff", 0.0) / max(summed.get("valid_first", 0.0), 1.0),
        "train_tokens": summed.get("valid", 0.0),
        "tokens_per_s": summed.get("tokens", 0.0) / max(t3 - t2, 1e-9),
        "padding_frac": _mean(padding),
        "turns_mean": _mean(len(t.steps) for t in rolled.scored),
        "time_rollout_s": t1 - t0,
        "time_tools_s": summed["tool_s"],
        "time_scoring_s": t2 - t1,
        "time_train_s": t3 - t2,
        "time_sync_s": t4 - t3,
        "step_time_s": t4 - t0,
        "sync_s": sync.seconds,
        "sync_bytes": float(sync.bytes),
        "memory_peak_gib": peak_memory_gib(),
        "model_tflops": summed.get("train_flops", 0.0) / 1e12,
        "rollout_tflops": summed["rollout_flops"] / 1e12,
        "is_weight_mean": summed.get("is_weight", 0.0) / valid,
        "is_capped_frac": summed.get("is_capped", 0.0) / valid,
        "stale_groups": float(sum(s.stale for s in generated)),
        "regenerated": float(sum(s.regenerated for s in generated)),
        "restarts": summed["restarts"],
        "time_wait_s": sum(s.wait_s for s in generated) / ranks,
        "trainer_idle_frac": sum(s.wait_s / max(s.elapsed_s, 1e-9) for s in generated) / ranks,
        "generator_idle_frac": sum(s.idle_s / max(s.elapsed_s, 1e-9) for s in generated) / ranks,
        **staleness_metrics(rolled.groups, version - minis, minis),
        **mismatch_metrics(summed),
        **rolled.judges,
    }
    for key in ("mean_pre_clamp_zeroed", "mean_pre_clamp_preserved"):
        if getattr(stats, key) is not None:
            record[key] = getattr(stats, key)
    utilisation = mfu(
        summed.get("train_flops", 0.0) + summed["rollout_flops"], t4 - t0, stage.world_size, stage.peak_tflops
    )
    if utilisation is not None:
        record["mfu"] = utilisation
    return record


def _tool_results(trajectories: Sequence[Trajectory]) -> list[ToolResult]:
    return [s.tool_result for t in trajectories for s in t.steps if s.tool_result is not None]


def _rollout_flops(trajectories: list[Trajectory], renderer: ChatRenderer, arch) -> float:
    """Engine FLOPs of this rank's rollouts (text decoder; the engine re-prefills every turn)."""
    turns = []
    for t in trajectories:
        prompt_tokens = len(renderer.render_prompt(t.prompt).ids)
        turns += trajectory_turns(prompt_tokens, [(len(s.token_ids), len(s.observation_token_ids)) for s in t.steps])
    return generation_flops(arch.text, turns)
