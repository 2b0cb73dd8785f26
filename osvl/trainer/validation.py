"""Evaluation rollouts: held-out prompts rolled out with the training prompt, tools and turn budget,
scored as in training and summarised. The GRPO stage's in-training validation (``validation.*``,
verl's ``val_*`` settings of paper Table 5) and the demo's ``evaluate`` both run through here.

In-training validation rolls the whole held-out file out every ``validation.every_steps`` steps and
at the last step, with the policy's current weights and without injected tool faults. Sampling seeds
are fixed (the same for every validation), so two validations differ only by the weights.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.distributed import rank_device
from osvl.rl.rewards import score_batch
from osvl.rl.trajectory import Prompt, Trajectory
from osvl.rollout import AgentConfig, Engine, RolloutWorkerConfig, stream_groups
from osvl.tools import ToolEnvironment
from osvl.tools.faults import FaultInjectingRunner
from osvl.trainer.grpo_data import load_prompts, reward_scoring, rollout_configs

VALIDATION_STEP = -1  # the rollout "step" of every validation: seeds depend on it, not on the training step
SUMMARY_KEYS = (
    "accuracy",
    "reward",
    "reward_fmt",
    "answered",
    "grounded",
    "fatal_rate",
    "turns_mean",
    "tool_calls",
    "no_tool_answers",
)


async def collect_rollouts(
    prompts: Sequence[Prompt],
    engine: Engine,
    env: ToolEnvironment,
    renderer: ChatRenderer,
    agent: AgentConfig,
    workers: RolloutWorkerConfig,
    *,
    step: int = 0,
) -> list[Trajectory]:
    """Every prompt's group of trajectories, in completion order."""
    out = []
    async for group in stream_groups(prompts, engine, env, renderer, agent, workers, step=step):
        out += group.trajectories
    return out


def answer_is_grounded(trajectory: Trajectory) -> bool:
    """Whether the final answer is stated word for word in one of the rollout's own tool
    observations: an answer read from the tools, right or wrong, rather than recalled."""
    answer = (trajectory.final_answer or "").strip()
    stated = re.compile(rf"(?<!\w){re.escape(answer)}(?!\w)")
    return bool(answer) and any(stated.search(step.observation_text) for step in trajectory.steps)


def summary_sums(scored: Sequence[Trajectory]) -> dict[str, float]:
    """Sums over trajectories (``scored``: those with a scored reward; ``trajectories``: all), so ranks
    can add theirs before ``summary_means`` divides."""
    rewards = [t.reward for t in scored if t.reward is not None and t.reward.scored]
    return {
        "trajectories": float(len(scored)),
        "scored": float(len(rewards)),
        "accuracy": sum(r.acc for r in rewards),
        "reward": sum(r.total for r in rewards),
        "reward_fmt": sum(r.fmt for r in rewards),
        "answered": float(sum(t.final_answer is not None for t in scored)),
        "grounded": float(sum(map(answer_is_grounded, scored))),
        "fatal_rate": float(sum(t.fatal_step >= 0 for t in scored)),
        "turns_mean": float(sum(len(t.steps) for t in scored)),
        "tool_calls": float(sum(_tool_calls(t) for t in scored)),
        "no_tool_answers": float(sum(t.final_answer is not None and _tool_calls(t) == 0 for t in scored)),
    }


def _tool_calls(trajectory: Trajectory) -> int:
    return sum(step.tool_result is not None for step in trajectory.steps)


def summary_means(sums: dict[str, float]) -> dict[str, float]:
    """Reward parts per scored trajectory, the rest per trajectory."""
    scored, total = max(sums["scored"], 1.0), max(sums["trajectories"], 1.0)
    per_scored = ("accuracy", "reward", "reward_fmt")
    return {key: sums[key] / (scored if key in per_scored else total) for key in SUMMARY_KEYS}


def without_faults(env: ToolEnvironment) -> ToolEnvironment:
    """The environment without ``tools.fault_rate`` (validation measures the policy, not the faults)."""
    if not isinstance(env.pool, FaultInjectingRunner):
        return env
    clean = copy.copy(env)  # keeps the environment's class (a tool profile translates calls)
    clean.pool = env.pool.runner
    return clean


class Validator:
    """The GRPO stage's validation hook: ``due(step, last)`` then ``run(engine, env)`` (collective).

    Rank ``r`` rolls out the prompts ``dp_rank, dp_rank + dp_size, ...`` when it is the first of its
    tensor-parallel group (its peers hold the same engine weights), ``batch_prompts / dp_size`` at a
    time; the sums are then added over all ranks.
    """

    def __init__(self, recipe: Recipe, renderer: ChatRenderer, rank: int, dp_size: int):
        v = recipe.validation
        if not v.path:
            raise ValueError("validation.path is empty: no held-out prompts to validate on")
        if not Path(v.path).is_file():
            raise ValueError(f"validation.path: {v.path} does not exist")
        self.config, self.renderer = v, renderer
        try:
            prompts = load_prompts(dataclasses.replace(recipe.data, train_path=v.path, format="auto"))
        except ValueError as error:
            raise ValueError(f"validation.path ({v.path}): {error}") from None
        tp = recipe.parallel.tp
        self.prompts = prompts[rank // tp :: dp_size] if rank % tp == 0 else []
        self.chunk = max(1, v.batch_prompts // dp_size)
        self.agent, self.workers = rollout_configs(
            recipe, temperature=v.temperature, top_p=v.top_p, group_size=v.samples_per_prompt
        )
        self.scoring = reward_scoring(recipe)
        self.num_prompts = len(prompts)

    def due(self, step: int, last_step: int) -> bool:
        return step % self.config.every_steps == 0 or step == last_step

    def run(
        self, engine: Engine, env: ToolEnvironment, run: Callable[[Coroutine], Any] = asyncio.run
    ) -> dict[str, float]:
        """``val/...`` metrics of the held-out prompts under the engine's current weights (``run``: the
        stage's event loop, where its engine's connections live)."""
        started = time.perf_counter()
        env = without_faults(env)
        scored: list[Trajectory] = []
        for start in range(0, len(self.prompts), self.chunk):
            chunk = self.prompts[start : start + self.chunk]
            rolled = run(
                collect_rollouts(chunk, engine, env, self.renderer, self.agent, self.workers, step=VALIDATION_STEP)
            )
            scored += score_batch(rolled, *self.scoring)
        sums = summary_sums(scored)
        keys = list(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=rank_device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(values)
        means = summary_means(dict(zip(keys, values.tolist())))
        return {
            **{f"val/{k}": v for k, v in means.items()},
            "val/prompts": float(self.num_prompts),
            "val/time_s": time.perf_counter() - started,
        }
