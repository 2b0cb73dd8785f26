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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.distributed import global_normalizers
from osvl.data.packing import PackedBatch, TrainSequence
from osvl.rl.advantages import AdvantageConfig, trajectory_advantages
from osvl.rl.scoring import GroupScorer, JudgeStats
from osvl.rl.stats import BatchStats, batch_stats
from osvl.rl.trajectory import Trajectory
from osvl.rollout import RolloutRecorder
from osvl.rollout.event_loop import EventLoopThread
from osvl.rollout.generator import GeneratorFailed, GeneratorStats, GroupsOverdue, RolloutGenerator
from osvl.rollout.replay import ScoredGroup
from osvl.serve.engines import EngineWrapper, build_serving
from osvl.serve.preflight import preflight
from osvl.step import grpo_loss_config, grpo_loss_on_hidden, optim_step, packed_forward, policy_logprobs
from osvl.tools.fleet import tool_fleet
from osvl.trainer.correction import mismatch_sums
from osvl.trainer.flops import packed_batch_flops, packed_forward_flops
from osvl.trainer.grpo_data import load_prompts, rank_minibatch, stage_scorer, training_sequences
from osvl.trainer.grpo_telemetry import (
    StepClock,
    rollout_flops,
    service_restarts,
    service_states,
    step_record,
)
from osvl.trainer.rollouts import GroupRoller, stage_generator
from osvl.trainer.router_losses import RouterLosses
from osvl.trainer.stage import Stage, StageResult, all_reduce_sums, stage_inputs, start_stage
from osvl.trainer.tool_env import EnvironmentFactory, stage_environment
from osvl.trainer.validation import Validator
from osvl.trainer.watchdog import WAIT_REPORT_S, Overdue, RunStopped, StepOverdue, step_deadline_s, stop_message
from osvl_kernels import GRPOLossConfig

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
        logprobs = [policy_logprobs(stage.model, b, g.temperature, g.loss_chunk) for b in batches]
        for b, lp in zip(batches, logprobs):
            for key, value in mismatch_sums(lp, b.old_logprobs.to(lp.device), b.loss_mask.to(lp.device)).items():
                _add(sums, key, value)
            _add(sums, "train_flops", packed_forward_flops(stage.model.arch, b))
        out.append(logprobs)
    return out


def train_minibatch(
    stage: Stage,
    batches: Sequence[PackedBatch],
    loss_config: GRPOLossConfig,
    sums: dict[str, torch.Tensor | float],
    router_losses: RouterLosses,
    first: bool,
    old_logprobs: Sequence[torch.Tensor] | None = None,
) -> None:
    """Forward, fused loss (and the MoE router losses) and backward of this rank's micro-batches of one
    mini-batch, then the optimizer step. The PPO ratio is taken against ``old_logprobs`` (the trainer's)
    when given, else against the engine's. Metric sums stay on the device (``sums``)."""
    norms = global_normalizers(batches)
    train_vision = not stage.recipe.model.freeze_vision
    router_losses.start(batches)
    for i, b in enumerate(batches):
        router_losses.prepare(b)  # reads host-side counts
        b, hidden = packed_forward(stage.model, b)
        old = b.old_logprobs if old_logprobs is None else old_logprobs[i].to(hidden.device)
        out = grpo_loss_on_hidden(
            stage.model,
            hidden,
            b,
            loss_config,
            chunk_size=stage.recipe.grpo.loss_chunk,
            old_logprobs=old,
            num_seqs=norms.num_seqs.clamp_min(1),
            num_tokens=norms.num_valid_tokens.clamp_min(1),
        )
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
    update = optim_step(stage.params, stage.optimizer, stage.scheduler, stage.recipe.optimizer)
    _add(sums, "grad_norm", update.grad_norm / stage.world_size)  # the global norm on every rank: sums to it
    _add(sums, "nonfinite_skipped", float(update.skipped) / stage.world_size)  # every rank skips alike


def _add(sums: dict[str, torch.Tensor | float], key: str, value: torch.Tensor | float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def pack_step(
    stage: Stage, sequences: Sequence[TrainSequence], renderer: ChatRenderer
) -> tuple[list[list[PackedBatch]], list[float]]:
    """This rank's micro-batches of each PPO mini-batch (whole groups, token-balanced over the ranks), and
    each mini-batch's padding fraction."""
    g = stage.recipe.grpo
    minis = g.batch_prompts // g.mini_batch_prompts
    packed = [
        rank_minibatch(
            [s for s in sequences if s.group_id // g.mini_batch_prompts == m],
            stage.recipe.data.max_tokens,
            stage.dp_size,
            stage.dp_rank,
            renderer,
        )
        for m in range(minis)
    ]
    return [list(batches) for batches, _ in packed], [padding for _, padding in packed]


def update_policy(
    stage: Stage,
    minibatches: Sequence[Sequence[PackedBatch]],
    loss_config: GRPOLossConfig,
    router_losses: RouterLosses,
    sums: dict[str, torch.Tensor | float],
) -> int:
    """One optimizer step per mini-batch (the old policy's log-probs first, when the recipe recomputes
    them); returns the number of updates, by which the policy version advances."""
    old = old_policy(stage, minibatches, router_losses, sums) if stage.recipe.grpo.old_logprobs == "trainer" else None
    stage.model.train()
    for m, batches in enumerate(minibatches):
        train_minibatch(
            stage, batches, loss_config, sums, router_losses, first=m == 0, old_logprobs=None if old is None else old[m]
        )
    return len(minibatches)


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
    loss_config = grpo_loss_config(g)  # the fused loss's settings, once for the stage
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
                clock = StepClock()
                with clock("rollout"):  # this rank's groups, judged as each completes, then every rank's
                    try:
                        rolled = rollout_step(generator, scorer, deadline, services)
                    except StepOverdue as late:
                        raise RunStopped(stop_together(stage, late.ranks)) from None
                with clock("advantages"):
                    advantages = trajectory_advantages(rolled.scored, advantage_config)
                    stats = batch_stats(advantages, rolled.scored)
                with clock("pack"):
                    sequences = training_sequences(rolled.scored, advantages, renderer)
                    minibatches, padding = pack_step(stage, sequences, renderer)
                with clock("update"):
                    sums: dict[str, torch.Tensor | float] = {}  # the step's metric sums, on the device
                    version += update_policy(stage, minibatches, loss_config, router_losses, sums)
                with clock("sync"):
                    sync = generator.update_weights(functools.partial(serving.sync.sync, stage.model, version), version)
                stage.step += 1
                sums["restarts"] = loop.run(roller.take_restarts())
                record = record_step(stage, rolled, stats, padding, sums, version, sync, clock, renderer)
                record.update(router_losses.metrics() | service_restarts(serving, fleet, loop))
                if rank == 0:
                    write_rollouts(recorder, stale_recorder, stage.step, rolled)
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


def record_step(
    stage: Stage,
    rolled: RolloutBatch,
    stats: BatchStats,
    padding: Sequence[float],
    sums: dict[str, torch.Tensor | float],
    version: int,
    sync,
    clock: StepClock,
    renderer: ChatRenderer,
) -> dict[str, float]:
    """The step's sums reduced over ranks once, then its metrics line."""
    sums["rollout_flops"] = rollout_flops(rolled.mine, renderer, stage.model.arch)
    sums["tool_s"] = sum(s.tool_result.elapsed_s for t in rolled.mine for s in t.steps if s.tool_result)
    summed = all_reduce_sums(sums)
    scored, groups, generated, judges = rolled.scored, rolled.groups, rolled.generated, rolled.judges
    return step_record(stage, summed, scored, groups, generated, judges, stats, padding, version, sync, clock)


def write_rollouts(recorder: RolloutRecorder, stale: RolloutRecorder, step: int, rolled: RolloutBatch) -> None:
    """The step's scored rollouts, and the groups the generator dropped past the staleness bound."""
    recorder.write(step, rolled.scored)
    dropped = [t for s in rolled.generated for group in s.dropped for t in group.trajectories]
    if dropped:
        stale.write(step, dropped)
