"""A pool of spawned worker processes that runs tool calls under hard deadlines.

One dispatcher thread per worker takes jobs from a bounded queue, sends each to its process over
a private pipe, and waits until the reply, the deadline, the process's death, or its RSS passing
the memory cap. Timeouts and memory overruns kill the process; every failure gives the caller a
typed ``ToolResult`` and the worker is replaced before it takes the next job. A deadline runs
from the moment a worker receives the call: time spent queueing behind other callers is ours, not
the policy's, and never turns into a ``timeout``. A job may also carry an end-to-end deadline
(``Job.end_to_end_s``) that counts its time in the queue: a call that cannot finish within it is an
``infra_error`` unless its own deadline ran out first. Each result records its queue and run
seconds and the worker process that ran it. The caller-facing API is ``submit`` (a
``concurrent.futures.Future``), ``call`` (sync) and ``acall`` (asyncio).

Starting the pool, and replacing a dead worker, sweeps the scratch directories that killed workers'
unsandboxed interpreter runs could not remove (:func:`osvl.tools.sandbox.sweep_stale_scratch`). Each
worker leads a session of its own, where its sandbox runs live; whenever the pool lets a worker go (a
deadline, the memory watchdog, its death by any signal, the pool's close) it kills that session before it
reaps the worker, so no process of a run outlives its worker (:func:`osvl.tools.sandbox.kill_session`).

Workers import ``PoolConfig.preload`` (the registry's targets) before they report ready, so module
imports count against ``startup_timeout_s``, never against a call's deadline. A target that fails
to import does not stop the pool: it is logged, kept in ``ToolPool.import_errors``, and every call
to it gets the import's error as an ``infra_error``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import multiprocessing as mp
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_ready
from typing import Any

import numpy as np

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools.config import ToolBackendsConfig
from osvl.tools.registry import check_target
from osvl.tools.sandbox import kill_session, sweep_stale_scratch
from osvl.tools.worker import worker_main

log = logging.getLogger(__name__)
_STOP = object()
# multiprocessing's Process.start() reaps every finished child of this process (its _cleanup()). A start on
# one dispatcher thread could thus reap a worker that another thread is killing: that thread's join() then
# sees no child, reads exit code None, and its session sweep may name a reused pid. Starts and kills take turns.
_REAP_LOCK = threading.Lock()
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class PoolBusy(Exception):
    """The job queue is full (back-pressure); retry later or wait with ``block=True``."""


class PoolClosed(RuntimeError):
    """The pool was closed; no job is accepted any more."""


@dataclass(frozen=True)
class PoolConfig:
    num_workers: int = 2
    max_queue: int = 64  # jobs waiting for a worker; submit blocks or raises PoolBusy beyond
    max_rss_bytes: int | None = 4 << 30  # RSS watchdog per worker; None disables it
    address_space_bytes: int | None = None  # RLIMIT_AS per worker (MemoryError instead of OOM)
    opencv_threads: int = 1  # per worker: workers, not OpenCV's thread pool, are the unit of parallelism
    startup_timeout_s: float = 120.0  # spawn plus the preload imports, per worker
    watch_interval_s: float = 0.05  # how often deadlines and RSS are checked while a job runs
    preload: tuple[str, ...] = ()  # "module:function" targets every worker imports before it is ready

    def __post_init__(self) -> None:
        object.__setattr__(self, "preload", tuple(self.preload))
        for target in self.preload:
            check_target(target, "PoolConfig.preload")
        if self.opencv_threads < 1:
            raise ValueError(f"PoolConfig.opencv_threads must be >= 1, got {self.opencv_threads}")
        if self.num_workers < 1 or self.max_queue < 1:
            raise ValueError(
                f"PoolConfig needs num_workers >= 1 and max_queue >= 1, got {self.num_workers} and {self.max_queue}"
            )
        for name in ("startup_timeout_s", "watch_interval_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"PoolConfig.{name} must be positive, got {value}")
        for name in ("max_rss_bytes", "address_space_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"PoolConfig.{name} must be positive or None, got {value}")


@dataclass
class Job:
    tool: str
    target: str  # "module:function"
    arguments: dict[str, Any]
    images: list[np.ndarray] = field(default_factory=list)
    deadline_s: float = 30.0  # the run's own deadline, from the moment a worker receives it
    options: dict[str, Any] = field(default_factory=dict)  # the spec's options, passed to the implementation
    end_to_end_s: float | None = None  # optional bound on queue + run, from submission

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"job deadline_s must be a positive number, got {self.deadline_s}")
        if self.end_to_end_s is not None and not (math.isfinite(self.end_to_end_s) and self.end_to_end_s > 0):
            raise ValueError(f"job end_to_end_s must be a positive number or None, got {self.end_to_end_s}")


@dataclass
class PoolStats:
    submitted: int = 0
    completed: int = 0
    timeouts: int = 0
    crashes: int = 0
    memory_kills: int = 0
    restarts: int = 0


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, tools_config: ToolBackendsConfig, pool_config: PoolConfig) -> None:
        self._ctx, self._tools_config, self._pool_config = ctx, tools_config, pool_config
        self.process: Any = None
        self.conn: Any = None
        self.import_errors: dict[str, str] = {}

    def start(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(
                child_conn,
                self._tools_config,
                self._pool_config.address_space_bytes,
                self._pool_config.opencv_threads,
                self._pool_config.preload,
            ),
            daemon=True,
            name="osvl-tool-worker",
        )
        with _REAP_LOCK:
            process.start()
        child_conn.close()
        self.process, self.conn = process, parent_conn
        timeout, preload = self._pool_config.startup_timeout_s, self._pool_config.preload
        if not parent_conn.poll(timeout):
            self.kill()
            imports = f" (importing {len(preload)} tool targets)" if preload else ""
            raise RuntimeError(
                f"tool worker did not start within {timeout}s{imports}; raise PoolConfig.startup_timeout_s"
            )
        try:
            _, (_, self.import_errors) = parent_conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(f"tool worker died while starting (exit code {process.exitcode})") from None

    def alive(self) -> bool:
        """Whether the process runs; never reaps it (``kill`` must find its pid, its session id, still held)."""
        return self.process is not None and not wait_ready([self.process.sentinel], 0)

    def rss_bytes(self) -> int | None:
        try:
            with open(f"/proc/{self.process.pid}/statm") as handle:
                return int(handle.read().split()[1]) * _PAGE_SIZE
        except (OSError, ValueError, IndexError):
            return None

    def kill(self, grace_s: float = 0.0) -> int | None:
        """Give the process ``grace_s`` to exit, SIGKILL it, kill every process left in its session (its
        sandbox runs), then reap it; returns its exit code (None when there was no process)."""
        code = None
        if self.process is not None:
            if grace_s:
                wait_ready([self.process.sentinel], grace_s)
            with _REAP_LOCK:  # no Process.start() may reap it before its session is killed and its code read
                self.process.kill()
                wait_ready([self.process.sentinel], 10)  # exited, not reaped: its pid still names its session
                kill_session(self.process.pid)
                self.process.join(timeout=10)
                code = self.process.exitcode
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None
        return code

    def stop(self) -> None:
        grace_s = 0.0
        if self.alive():
            try:
                self.conn.send(None)
                grace_s = 2.0
            except (BrokenPipeError, OSError):
                pass
        self.kill(grace_s)


class ToolPool:
    """Runs ``Job``s in spawned workers; ``import_errors`` maps preloaded targets that failed to import
    to their error."""

    def __init__(self, tools_config: ToolBackendsConfig | None = None, config: PoolConfig | None = None) -> None:
        self.tools_config = tools_config or ToolBackendsConfig()
        self.config = config or PoolConfig()
        self.stats = PoolStats()
        self._ctx = mp.get_context("spawn")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self.config.max_queue)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        sweep_stale_scratch()
        self._workers = [_Worker(self._ctx, self.tools_config, self.config) for _ in range(self.config.num_workers)]
        with ThreadPoolExecutor(max_workers=len(self._workers)) as starter:  # spawn in parallel
            failures = [f.exception() for f in [starter.submit(w.start) for w in self._workers]]
        failures = [f for f in failures if f is not None]
        if failures:
            self._shutdown_workers()
            raise RuntimeError(f"tool pool: a worker process failed to start: {failures[0]}")
        self.import_errors = self._workers[0].import_errors  # the same targets, so the same failures
        for target, error in self.import_errors.items():
            log.warning("tool target %s cannot be imported; its calls will fail: %s", target, error)
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), daemon=True, name=f"osvl-tool-dispatch-{i}")
            for i, w in enumerate(self._workers)
        ]
        for thread in self._threads:
            thread.start()

    # -- caller side ------------------------------------------------------------------------

    def submit(self, job: Job, block: bool = True, timeout: float | None = None) -> Future[ToolResult]:
        """Queue a job; with ``block=False`` (or after ``timeout``) a full queue raises ``PoolBusy``."""
        if self._closed:
            raise PoolClosed("the tool pool is closed")
        future: Future[ToolResult] = Future()
        try:
            self._queue.put((job, future, time.monotonic()), block=block, timeout=timeout)
        except queue.Full:
            raise PoolBusy(f"tool queue is full ({self.config.max_queue} jobs waiting)") from None
        with self._lock:
            self.stats.submitted += 1
        return future

    def call(self, job: Job) -> ToolResult:
        return self.submit(job).result()

    async def acall(self, job: Job) -> ToolResult:
        """Async submit: waits for queue space without blocking the event loop."""
        try:
            future = self.submit(job, block=False)
        except PoolBusy:
            future = await asyncio.to_thread(self.submit, job, True)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._shutdown_workers()

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int | None]:
        return [w.process.pid if w.process is not None else None for w in self._workers]

    # -- dispatcher side --------------------------------------------------------------------

    def _shutdown_workers(self) -> None:
        for worker in self._workers:
            worker.stop()

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _serve(self, worker: _Worker) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, future, submitted = item
            if not future.set_running_or_notify_cancel():
                continue
            started = time.monotonic()
            queue_s = started - submitted
            pid = worker.process.pid if worker.process is not None else None
            if job.end_to_end_s is not None and queue_s >= job.end_to_end_s:
                status, text, images, replace = ToolStatus.INFRA_ERROR, "", [], False
                error = (
                    f"{job.tool} waited {queue_s:.2f}s for a worker; its end-to-end deadline of "
                    f"{job.end_to_end_s:g}s passed before it could run"
                )
                pid = None
            else:
                try:
                    status, text, images, error, replace, pid = self._run(worker, job, queue_s)
                except Exception as err:  # the dispatcher itself must never die
                    status, text, images, error, replace = (
                        ToolStatus.INFRA_ERROR,
                        "",
                        [],
                        f"tool pool error: {err}",
                        True,
                    )
            run_s = time.monotonic() - started
            future.set_result(
                ToolResult(
                    status=status,
                    tool=job.tool,
                    text=text,
                    images=images,
                    error=error,
                    elapsed_s=queue_s + run_s,
                    queue_s=queue_s,
                    run_s=run_s,
                    worker="" if pid is None else f"pid {pid}",
                )
            )
            self._count("completed")
            if replace or not worker.alive():
                self._replace(worker)

    def _replace(self, worker: _Worker) -> bool:
        """Start a fresh process in place of this one; False when it would not start."""
        worker.kill()
        self._count("restarts")
        sweep_stale_scratch()
        try:
            worker.start()
        except RuntimeError:
            return False
        return True

    def _run(
        self, worker: _Worker, job: Job, queue_s: float
    ) -> tuple[ToolStatus, str, list[np.ndarray], str | None, bool, int | None]:
        """(status, text, images, error, replace the worker, pid of the worker that ran it)."""
        if not worker.alive() and not self._replace(worker):
            return ToolStatus.INFRA_ERROR, "", [], "no tool worker could be started for this call", True, None
        pid = worker.process.pid
        return (*self._exchange(worker, job, queue_s), pid)

    def _exchange(
        self, worker: _Worker, job: Job, queue_s: float
    ) -> tuple[ToolStatus, str, list[np.ndarray], str | None, bool]:
        job_id = next(self._ids)
        try:
            worker.conn.send((job_id, job.target, job.arguments, job.images, job.options))
        except (BrokenPipeError, OSError) as err:
            self._count("crashes")
            return ToolStatus.INFRA_ERROR, "", [], f"could not reach the tool worker: {err}", True
        allowed = job.deadline_s
        if job.end_to_end_s is not None:
            allowed = min(allowed, job.end_to_end_s - queue_s)
        deadline = time.monotonic() + allowed
        limit = self.config.max_rss_bytes
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._count("timeouts")
                if allowed < job.deadline_s:  # cut short by time our queue took, not by the call itself
                    return (
                        ToolStatus.INFRA_ERROR,
                        "",
                        [],
                        f"{job.tool} waited {queue_s:.2f}s for a worker and "
                        f"could not finish within its end-to-end deadline of {job.end_to_end_s:g}s",
                        True,
                    )
                return ToolStatus.TIMEOUT, "", [], f"{job.tool} did not finish within {job.deadline_s:g}s", True
            if worker.conn.poll(min(remaining, self.config.watch_interval_s)):
                try:
                    reply = worker.conn.recv()
                except (EOFError, OSError):
                    code = worker.kill(grace_s=5.0)
                    self._count("crashes")
                    return (
                        ToolStatus.INFRA_ERROR,
                        "",
                        [],
                        f"the {job.tool} worker process died (exit code {code})",
                        True,
                    )
                reply_id, status, text, images, error, retire = reply
                if reply_id != job_id:
                    return ToolStatus.INFRA_ERROR, "", [], "tool worker answered a different job", True
                return ToolStatus(status), text, images, error, retire
            if limit is not None:
                rss = worker.rss_bytes()
                if rss is not None and rss > limit:
                    self._count("memory_kills")
                    return (
                        ToolStatus.INFRA_ERROR,
                        "",
                        [],
                        f"the {job.tool} worker used {rss >> 20} MiB, over the {limit >> 20} MiB limit",
                        True,
                    )
