"""What the GRPO stage records about a step: the metrics line, the named timing spans of the loop, the
services' restarts and states. Apart from the loop (``osvl.trainer.grpo``) so it reads as the algorithm."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

from osvl.data.chat import ChatRenderer
from osvl.rl.fatal import has_infra_error
from osvl.rl.scoring import GroupScorer
from osvl.rl.stats import BatchStats, group_signal
from osvl.rl.trajectory import ToolResult, Trajectory
from osvl.rollout.event_loop import EventLoopThread
from osvl.rollout.generator import GeneratorStats
from osvl.rollout.replay import ScoredGroup, staleness_metrics
from osvl.serve.engines import Serving
from osvl.tools.fleet import ToolServerFleet
from osvl.trainer.correction import mismatch_metrics
from osvl.trainer.flops import generation_flops, mfu, trajectory_turns
from osvl.trainer.metrics import peak_memory_gib
from osvl.trainer.stage import Stage, all_reduce_max
from osvl.trainer.validation import answer_is_grounded


class StepClock:
    """Wall-clock seconds of a step's named spans (``with clock("update"): ...``), each also a
    ``torch.profiler`` range (``grpo/<name>``) so a trace shows the same names."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        with torch.profiler.record_function(f"grpo/{name}"):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def service_states(serving: Serving, fleet: ToolServerFleet | None, scorer: GroupScorer) -> str:
    """What the services last answered, for a rank that waited too long."""
    tools = f"tool servers: {fleet.health()}" if fleet is not None else "tools: local workers"
    return f"engine: {type(serving.engine).__name__}; {tools}; judges: {scorer.describe()}"


def service_restarts(serving: Serving, fleet: ToolServerFleet | None, loop: EventLoopThread) -> dict[str, float]:
    """The step's restarts of services as the trainer saw them (the largest count over ranks: every rank
    may see the same restart): tool servers that came back as a new process, engine servers that went
    away and came back (given the trainer's weights again when they had lost them)."""
    return all_reduce_max(
        {
            "tool_server_restarts": fleet.take_restarts() if fleet is not None else 0,
            "engine_restarts": loop.run(serving.take_restarts()),
        }
    )


def step_record(
    stage: Stage,
    summed: dict[str, float],
    scored: Sequence[Trajectory],
    groups: Sequence[ScoredGroup],
    generated: Sequence[GeneratorStats],
    judges: dict[str, float],
    stats: BatchStats,
    padding: Sequence[float],
    version: int,
    sync,
    clock: StepClock,
) -> dict[str, float]:
    """The step's metrics line (every value reduced over ranks where it is a sum). ``version`` is the
    policy version after the step's updates; the step trained from ``version - updates``. The step's
    time ends with its weight sync."""
    spans, step_s = clock.seconds, clock.elapsed()
    recipe = stage.recipe
    valid = max(summed.get("valid", 0.0), 1.0)
    parts = [t.reward for t in scored if t.reward is not None and t.reward.scored]
    minis = recipe.grpo.batch_prompts // recipe.grpo.mini_batch_prompts
    ranks = len(generated)
    record = {
        "loss": summed.get("loss", 0.0) / max(recipe.parallel.tp, 1),
        "grad_norm": summed["grad_norm"] / minis,
        "nonfinite_skipped": summed["nonfinite_skipped"],
        "lr": stage.scheduler.get_last_lr()[0],
        "policy_version": version,
        "reward": _mean(p.total for p in parts),
        "reward_fmt": _mean(p.fmt for p in parts),
        "reward_acc": _mean(p.acc for p in parts),
        "reward_query": _mean(p.query for p in parts),
        "accuracy": _mean(p.acc for p in parts),
        "grounded": _mean(map(answer_is_grounded, scored)),  # answers read from a tool, right or wrong
        **group_signal(scored).as_metrics(),
        "fatal_rate": stats.fatal_fraction or 0.0,
        "clamped_frac": stats.clamped_fraction or 0.0,
        "fatal": stats.fatal,
        "clamped": stats.clamped,
        "preserved": stats.preserved,
        "dropped": stats.infra_dropped + stats.unscored + stats.hard_masked,
        "unscored": stats.unscored,
        "infra_dropped": stats.infra_dropped,
        "infra_kept": stats.infra_kept,
        "infra_hit": sum(map(has_infra_error, scored)),
        "tool_calls_mean": _mean(sum(s.tool_result is not None for s in t.steps) for t in scored),
        "tool_calls_overloaded": sum(r.overloads > 0 for r in _tool_results(scored)),
        "tool_overload_failures": sum(r.overloaded for r in _tool_results(scored)),
        "clip_frac": summed.get("clip", 0.0) / valid,
        "entropy": summed.get("entropy", 0.0) / valid,
        "kl": summed.get("kl_old", 0.0) / valid,
        "logprob_abs_diff": summed.get("lp_diff", 0.0) / max(summed.get("valid_first", 0.0), 1.0),
        "train_tokens": summed.get("valid", 0.0),
        "tokens_per_s": summed.get("tokens", 0.0) / max(spans["update"], 1e-9),
        "padding_frac": _mean(padding),
        "turns_mean": _mean(len(t.steps) for t in scored),
        "time_rollout_s": spans["rollout"],  # judging overlaps it: each group is scored as it completes
        "time_tools_s": summed["tool_s"],
        "time_advantages_s": spans["advantages"],
        "time_pack_s": spans["pack"],
        "time_train_s": spans["update"],
        "time_sync_s": spans["sync"],
        "step_time_s": step_s,
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
        **staleness_metrics(groups, version - minis, minis),
        **mismatch_metrics(summed),
        **judges,
    }
    for key in ("mean_pre_clamp_zeroed", "mean_pre_clamp_preserved"):
        if getattr(stats, key) is not None:
            record[key] = getattr(stats, key)
    utilisation = mfu(
        summed.get("train_flops", 0.0) + summed["rollout_flops"], step_s, stage.world_size, stage.peak_tflops
    )
    if utilisation is not None:
        record["mfu"] = utilisation
    return record


def _tool_results(trajectories: Sequence[Trajectory]) -> list[ToolResult]:
    return [s.tool_result for t in trajectories for s in t.steps if s.tool_result is not None]


def rollout_flops(trajectories: list[Trajectory], renderer: ChatRenderer, arch) -> float:
    """Engine FLOPs of this rank's rollouts (text decoder; the engine re-prefills every turn)."""
    turns = []
    for t in trajectories:
        prompt_tokens = len(renderer.render_prompt(t.prompt).ids)
        turns += trajectory_turns(prompt_tokens, [(len(s.token_ids), len(s.observation_token_ids)) for s in t.steps])
    return generation_flops(arch.text, turns)


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0
