"""Rollout workers: many trajectories in flight, groups of G kept together, streamed with back-pressure.

Each trajectory runs under a deadline; one that times out, or ends in an infra error (engine or,
under ``infra_rollouts = "drop"``, tool infrastructure), is retried up to ``max_retries`` times and
otherwise kept as it is (an empty ``infra_error`` record when it never finished), so its group
still completes and the trainer can drop it. A group is
yielded once all of its G samples are final; at most ``queue_size`` finished groups wait for the
consumer before producers block.

Under ``rollout.partial_rollouts = "restart"`` a weight update (``Preemption``) aborts every
trajectory in flight, which starts again from its prompt once the update is done; a restart is
neither an infra retry nor a failure. Staleness is judged per group, by the replay buffer
(:mod:`osvl.rollout.replay`), never per trajectory: groups stay whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from osvl.data.chat import ChatRenderer
from osvl.rl.fatal import INFRA_ROLLOUTS, InfraRollouts, infra_excluded, is_fatal
from osvl.rl.trajectory import FinishReason, Prompt, Trajectory
from osvl.rollout.agent import AgentConfig, run_trajectory
from osvl.rollout.engine import Engine, GenerationPreempted, derive_seed
from osvl.tools.environment import ToolEnvironment


@dataclass(frozen=True)
class RolloutWorkerConfig:
    group_size: int = 8
    max_in_flight: int = 64  # trajectories running concurrently
    trajectory_deadline_s: float = 900.0
    max_retries: int = 1  # per trajectory, for deadlines and infra errors
    queue_size: int = 4  # finished groups waiting for the consumer
    base_seed: int = 0
    infra_rollouts: InfraRollouts = "drop"  # keep: a tool's infra_error is data (not retried); see osvl.rl.fatal

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_in_flight < 1 or self.queue_size < 1:
            raise ValueError("group_size, max_in_flight and queue_size must be >= 1")
        if not self.trajectory_deadline_s > 0:
            raise ValueError(f"trajectory_deadline_s must be positive, got {self.trajectory_deadline_s}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.infra_rollouts not in INFRA_ROLLOUTS:
            raise ValueError(f"infra_rollouts must be one of {INFRA_ROLLOUTS}, got {self.infra_rollouts!r}")


@dataclass
class Group:
    prompt: Prompt
    group_id: int
    trajectories: list[Trajectory]


@dataclass
class RolloutMetrics:
    started: float = field(default_factory=time.monotonic)
    trajectories: int = 0
    turns: int = 0
    fatal: int = 0
    dropped: int = 0  # kept as infra_error records after the last retry
    retries: int = 0
    restarts: int = 0  # trajectories started again after a weight update preempted them
    engine_tokens: int = 0
    tool_calls: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)

    def record(self, traj: Trajectory) -> None:
        self.trajectories += 1
        self.turns += len(traj.steps)
        self.fatal += is_fatal(traj.fatal_step)
        self.dropped += traj.finish_reason is FinishReason.INFRA_ERROR
        for step in traj.steps:
            self.engine_tokens += len(step.token_ids)
            if step.tool_result is not None:
                self.tool_calls[step.tool_result.tool or "<unparsed>"] += 1
                self.statuses[step.tool_result.status.value] += 1

    def summary(self) -> dict[str, float | dict[str, int]]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        n = max(self.trajectories, 1)
        return {
            "trajectories_per_s": self.trajectories / elapsed,
            "turns_mean": self.turns / n,
            "fatal_rate": self.fatal / n,
            "dropped": self.dropped,
            "retries": self.retries,
            "restarts": self.restarts,
            "engine_tokens_per_s": self.engine_tokens / elapsed,
            "tool_calls": dict(self.tool_calls),
            "statuses": dict(self.statuses),
        }


class Preemption:
    """Weight updates as the rollout workers see them under ``partial_rollouts = "restart"``: ``begin``
    aborts every trajectory in flight, and they start again once ``end`` says the new weights serve.
    Both run on the workers' event loop."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._next = asyncio.Event()  # set by the next update

    def begin(self) -> None:
        self._open.clear()
        fired, self._next = self._next, asyncio.Event()
        fired.set()

    def end(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def next_update(self) -> asyncio.Event:
        return self._next


async def _attempt(rollout, preemption: Preemption | None) -> Trajectory | None:
    """One rollout under its deadline; None when a weight update preempted it."""
    if preemption is None:
        try:
            return await rollout
        except GenerationPreempted:
            return None
    await preemption.wait_open()
    update = preemption.next_update()
    task = asyncio.ensure_future(rollout)
    waiter = asyncio.ensure_future(update.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    try:
        return task.result()
    except GenerationPreempted:  # the engine aborted it first (a server paused by another rank)
        return None


async def _sample(
    prompt: Prompt,
    group_id: int,
    index: int,
    step: int,
    engine: Engine,
    env: ToolEnvironment,
    renderer: ChatRenderer,
    agent: AgentConfig,
    config: RolloutWorkerConfig,
    slots: asyncio.Semaphore,
    metrics: RolloutMetrics,
    preemption: Preemption | None,
) -> Trajectory:
    seed = derive_seed(step, prompt.id, index, config.base_seed)
    attempt = 0
    while True:
        async with slots:
            rollout = asyncio.wait_for(
                run_trajectory(prompt, engine, env, renderer, agent, group_id=group_id, sample_index=index, seed=seed),
                config.trajectory_deadline_s,
            )
            try:
                traj = await _attempt(rollout, preemption)
            except TimeoutError:
                traj = Trajectory(prompt, [], FinishReason.INFRA_ERROR, group_id, index)
        if traj is None:
            metrics.restarts += 1
            if preemption is not None:
                await preemption.wait_open()
            continue
        traj.infra_retries = attempt
        if not infra_excluded(traj, config.infra_rollouts) or attempt == config.max_retries:
            return traj
        metrics.retries += 1
        attempt += 1


async def run_group(
    prompt: Prompt,
    group_id: int,
    engine: Engine,
    env: ToolEnvironment,
    renderer: ChatRenderer,
    agent: AgentConfig,
    config: RolloutWorkerConfig,
    *,
    step: int = 0,
    slots: asyncio.Semaphore | None = None,
    metrics: RolloutMetrics | None = None,
    preemption: Preemption | None = None,
) -> Group:
    """All G samples of one prompt, each final (retried or kept as an ``infra_error`` record).

    ``slots`` bounds trajectories in flight across the groups that share it; ``metrics`` receives
    retry and restart counts (trajectories are recorded by whoever consumes the group); with
    ``preemption`` a weight update restarts the samples in flight.
    """
    slots = slots if slots is not None else asyncio.Semaphore(config.max_in_flight)
    metrics = metrics if metrics is not None else RolloutMetrics()
    samples = await asyncio.gather(
        *[
            _sample(prompt, group_id, i, step, engine, env, renderer, agent, config, slots, metrics, preemption)
            for i in range(config.group_size)
        ]
    )
    return Group(prompt, group_id, list(samples))


async def stream_groups(
    prompts: Sequence[Prompt],
    engine: Engine,
    env: ToolEnvironment,
    renderer: ChatRenderer,
    agent: AgentConfig,
    config: RolloutWorkerConfig,
    *,
    step: int = 0,
    metrics: RolloutMetrics | None = None,
) -> AsyncIterator[Group]:
    """Yields each prompt's group of G trajectories as soon as the whole group is final."""
    metrics = metrics if metrics is not None else RolloutMetrics()
    slots = asyncio.Semaphore(config.max_in_flight)
    done: asyncio.Queue[Group | Exception] = asyncio.Queue(maxsize=config.queue_size)

    async def group(prompt: Prompt, group_id: int) -> None:
        try:
            result = await run_group(
                prompt, group_id, engine, env, renderer, agent, config, step=step, slots=slots, metrics=metrics
            )
        except Exception as error:  # noqa: BLE001 - a bug surfaces at the consumer, not as a hang
            await done.put(error)
            return
        for traj in result.trajectories:
            metrics.record(traj)
        await done.put(result)

    tasks = [asyncio.create_task(group(p, g)) for g, p in enumerate(prompts)]
    try:
        for _ in tasks:
            item = await done.get()
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        for task in tasks:
            task.cancel()
