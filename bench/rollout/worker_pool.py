"""Rollout workers in side processes: N processes, each an asyncio loop with many trajectories in
flight, fed prompts and returning whole groups of G to an iterator in the trainer's process.

Flow control is by credits: a worker holds at most ``groups_per_worker`` groups, and a group's
credit comes back only when the consumer pulls the next group, so a slow trainer stops the feed
instead of piling groups up (no pipe ever holds more than its worker's credits). A worker that
dies, or keeps a group past ``group_deadline_s`` (it is then killed), is replaced with the newest
weights; its groups go back to the queue up to ``max_group_retries`` times and are otherwise
returned as ``infra_error`` records (``RolloutMetrics.dropped``), so a stream always ends.

Only ``bench_rollout`` runs it (the worker-process configurations it measures against in-process
rollouts), so it lives with the benchmark rather than in ``osvl.rollout``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Self

import torch

from bench.rollout.engine_process import (
    await_ready,
    load_weights_file,
    save_weights,
    shared_memory_dir,
    spawn,
    start_context,
)
from osvl.data.chat import ChatRenderer
from osvl.rl.trajectory import FinishReason, Prompt, Trajectory
from osvl.rollout.agent import AgentConfig
from osvl.rollout.engine import Engine
from osvl.rollout.workers import Group, RolloutMetrics, RolloutWorkerConfig, run_group
from osvl.tools.environment import ToolEnvironment


@dataclass
class RolloutSetup:
    """Everything one worker rolls out with; built inside the worker by the pool's factory."""

    engine: Engine
    env: ToolEnvironment
    renderer: ChatRenderer
    agent: AgentConfig
    rollout: RolloutWorkerConfig


SetupFactory = Callable[[], RolloutSetup]  # picklable (module-level function or functools.partial)


@dataclass(frozen=True)
class WorkerPoolConfig:
    num_workers: int = 2
    groups_per_worker: int = 4  # groups in flight per worker (its credits)
    group_deadline_s: float = 3600.0  # a worker holding a group longer is presumed stuck and killed
    max_group_retries: int = 1  # resubmissions of a group lost with its worker
    startup_timeout_s: float = 120.0
    start_method: str = "forkserver"
    weights_dir: str | None = None  # None = shared memory (/dev/shm) or the temp dir

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.groups_per_worker < 1:
            raise ValueError(
                f"num_workers and groups_per_worker must be >= 1, got {self.num_workers} and {self.groups_per_worker}"
            )
        if not (self.group_deadline_s > 0 and self.startup_timeout_s > 0):
            raise ValueError("group_deadline_s and startup_timeout_s must be positive")
        if self.max_group_retries < 0:
            raise ValueError(f"max_group_retries must be >= 0, got {self.max_group_retries}")
        start_context(self.start_method)


@dataclass
class WorkerPoolStats:
    deaths: int = 0  # workers lost (crash or deadline kill)
    deadline_kills: int = 0
    group_retries: int = 0
    groups_dropped: int = 0


def _worker_main(conn: Any, factory: SetupFactory) -> None:
    try:
        setup = factory()
    except BaseException as error:  # noqa: BLE001 - reported by the parent, which refuses to start
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", (os.getpid(), setup.rollout.group_size)))
    asyncio.run(_work(conn, setup))


async def _work(conn: Any, setup: RolloutSetup) -> None:
    slots = asyncio.Semaphore(setup.rollout.max_in_flight)
    send_lock = threading.Lock()
    tasks: set[asyncio.Task] = set()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    async def group(key: tuple[int, int], prompt: Prompt, step: int) -> None:
        metrics = RolloutMetrics()
        try:
            result = await run_group(
                prompt,
                key[1],
                setup.engine,
                setup.env,
                setup.renderer,
                setup.agent,
                setup.rollout,
                step=step,
                slots=slots,
                metrics=metrics,
            )
            message = ("group", key, (result, metrics.retries))
        except Exception as error:  # noqa: BLE001 - a bug is raised at the consumer, not hidden
            message = ("error", key, f"{type(error).__name__}: {error}")
        await asyncio.to_thread(send, message)

    async def weights(path: str, version: int) -> None:
        try:
            await asyncio.to_thread(load_weights_file, setup.engine, path, version)
            message = ("weights", version, None)
        except Exception as error:  # noqa: BLE001
            message = ("weights", version, f"{type(error).__name__}: {error}")
        await asyncio.to_thread(send, message)

    while True:
        try:
            message = await asyncio.to_thread(conn.recv)
        except (EOFError, OSError):
            return
        if message is None:
            return
        kind, *payload = message
        task = asyncio.create_task(group(*payload) if kind == "group" else weights(*payload))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


@dataclass
class _Worker:
    process: Any
    conn: Any
    pid: int = 0
    group_size: int = 0
    groups: dict[tuple[int, int], tuple[Prompt, float]] = field(default_factory=dict)  # (stream, id) -> sent


class RolloutWorkerPool:
    """``with RolloutWorkerPool(factory, config) as pool: for group in pool.stream(prompts, step=s): ...``

    Use it from one thread. ``load_weights`` may run between or during streams.
    """

    def __init__(self, factory: SetupFactory, config: WorkerPoolConfig | None = None) -> None:
        self.factory = factory
        self.config = config or WorkerPoolConfig()
        self.stats = WorkerPoolStats()
        self._ctx = start_context(self.config.start_method)
        self._streams = itertools.count()
        self._finished: dict[int, deque[Group]] = {}  # per live stream, groups waiting for the consumer
        self._errors: dict[int, str] = {}
        self._pending_retry: dict[int, deque[tuple[int, Prompt]]] = {}
        self._attempts: dict[tuple[int, int], int] = {}
        self._metrics: dict[int, RolloutMetrics] = {}
        self._weights: tuple[str, int] | None = None
        self._acks: set[int] = set()  # pids that confirmed the newest weights
        self._weight_error: str | None = None
        self._closed = False
        processes = [self._launch() for _ in range(self.config.num_workers)]
        self._workers: list[_Worker] = []
        try:
            for process, conn in processes:
                self._workers.append(self._await_ready(process, conn))
        except BaseException:
            for process, conn in processes:
                process.kill()
                conn.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------

    def _launch(self) -> tuple[Any, Any]:
        return spawn(self._ctx, _worker_main, self.factory, "osvl-rollout-worker")

    def _await_ready(self, process: Any, conn: Any) -> _Worker:
        payload = await_ready(process, conn, self.config.startup_timeout_s, "rollout worker", RuntimeError)
        worker = _Worker(process, conn, *payload)
        if self._weights is not None:
            conn.send(("weights", *self._weights))
        return worker

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker``, hand its groups back (or drop them) and start a successor."""
        self.stats.deaths += 1
        worker.process.kill()
        worker.process.join(10)
        worker.conn.close()
        for (stream, group_id), (prompt, _) in worker.groups.items():
            if stream not in self._finished:
                continue  # the consumer abandoned that stream
            attempts = self._attempts[stream, group_id] = self._attempts.get((stream, group_id), 0) + 1
            if attempts <= self.config.max_group_retries:
                self.stats.group_retries += 1
                self._pending_retry[stream].appendleft((group_id, prompt))
            else:
                self.stats.groups_dropped += 1
                lost = [
                    Trajectory(prompt, [], FinishReason.INFRA_ERROR, group_id, i, infra_retries=attempts - 1)
                    for i in range(worker.group_size)
                ]
                self._deliver(stream, Group(prompt, group_id, lost), 0)
        index = self._workers.index(worker)
        self._workers[index] = self._await_ready(*self._launch())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(5)
            worker.conn.close()
        if self._weights is not None:
            Path(self._weights[0]).unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    @property
    def groups_in_flight(self) -> int:
        return sum(len(worker.groups) for worker in self._workers)

    # -- messages ---------------------------------------------------------------------------

    def _deliver(self, stream: int, group: Group, retries: int) -> None:
        metrics = self._metrics[stream]
        for traj in group.trajectories:
            metrics.record(traj)
        metrics.retries += retries
        self._finished[stream].append(group)

    def _handle(self, worker: _Worker, message: tuple) -> None:
        kind, key, payload = message
        if kind == "weights":
            if payload is not None:
                self._weight_error = f"worker {worker.pid} rejected weights v{key}: {payload}"
            elif self._weights is not None and key == self._weights[1]:
                self._acks.add(worker.pid)
            return
        worker.groups.pop(key, None)
        stream = key[0]
        if stream not in self._finished:
            return  # an abandoned stream's group: its credit is back, the result is not wanted
        if kind == "error":
            self._errors[stream] = payload
        else:
            self._deliver(stream, *payload)

    def _pump(self, timeout: float) -> None:
        """Reads whatever workers sent within ``timeout``; replaces dead and stuck workers."""
        by_handle: dict[Any, _Worker] = {}
        for worker in self._workers:
            by_handle[worker.conn] = worker
            by_handle[worker.process.sentinel] = worker
        dead: list[_Worker] = []
        for handle in wait(list(by_handle), timeout):
            worker = by_handle[handle]
            if worker in dead:
                continue
            try:
                while worker.conn.poll():  # read all it sent, even if it died right after
                    self._handle(worker, worker.conn.recv())
            except (EOFError, OSError):
                dead.append(worker)
                continue
            if handle is worker.process.sentinel:
                dead.append(worker)
        now = time.monotonic()
        for worker in self._workers:
            if worker not in dead and any(
                now - sent > self.config.group_deadline_s for _, sent in worker.groups.values()
            ):
                self.stats.deadline_kills += 1
                dead.append(worker)
        for worker in dead:
            self._replace(worker)

    def _next_deadline(self) -> float:
        sent = [s for worker in self._workers for _, s in worker.groups.values()]
        if not sent:
            return 1.0
        return max(0.0, min(min(sent) + self.config.group_deadline_s - time.monotonic(), 1.0))

    # -- trainer API ------------------------------------------------------------------------

    def stream(
        self, prompts: Sequence[Prompt], *, step: int = 0, metrics: RolloutMetrics | None = None
    ) -> Iterator[Group]:
        """Yields each prompt's group (group_id = its index) as soon as all G samples are final."""
        if self._closed:
            raise ValueError("the rollout worker pool is closed")
        stream = next(self._streams)
        self._metrics[stream] = metrics if metrics is not None else RolloutMetrics()
        self._finished[stream] = deque()
        self._pending_retry[stream] = deque()
        fresh = deque(enumerate(prompts))
        try:
            for _ in range(len(prompts)):
                while not self._finished[stream]:
                    if stream in self._errors:
                        raise RuntimeError(f"a rollout worker failed on a group: {self._errors.pop(stream)}")
                    self._dispatch(stream, step, fresh)
                    self._pump(self._next_deadline())
                yield self._finished[stream].popleft()
        finally:
            for table in (self._metrics, self._finished, self._pending_retry, self._errors):
                table.pop(stream, None)
            self._attempts = {k: v for k, v in self._attempts.items() if k[0] != stream}

    def _dispatch(self, stream: int, step: int, fresh: deque[tuple[int, Prompt]]) -> None:
        retry = self._pending_retry[stream]
        for worker in sorted(self._workers, key=lambda w: len(w.groups)):
            while len(worker.groups) < self.config.groups_per_worker and (retry or fresh):
                group_id, prompt = retry.popleft() if retry else fresh.popleft()
                try:
                    worker.conn.send(("group", (stream, group_id), prompt, step))
                except (BrokenPipeError, OSError):
                    retry.appendleft((group_id, prompt))
                    break  # the next pump sees it dead and replaces it
                worker.groups[stream, group_id] = (prompt, time.monotonic())

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Every worker's engine holds ``version`` when this returns; a rejected update raises ValueError."""
        if self._closed:
            raise ValueError("the rollout worker pool is closed")
        path = save_weights(state_dict, version, self.config.weights_dir or shared_memory_dir())
        previous, self._weights, self._acks = self._weights, (str(path), version), set()
        for worker in self._workers:
            try:
                worker.conn.send(("weights", str(path), version))
            except (BrokenPipeError, OSError):
                pass  # its successor starts with these weights
        while not {w.pid for w in self._workers} <= self._acks:
            if self._weight_error is not None:
                error, self._weight_error, self._weights = self._weight_error, None, previous
                path.unlink(missing_ok=True)
                raise ValueError(error)
            self._pump(self._next_deadline())
        if previous is not None:
            Path(previous[0]).unlink(missing_ok=True)
