"""Tool calls spread over several tool servers (``osvl.tools.server``), with failover.

A call goes to the healthy server with the fewest calls in flight. A server that fails a call
with an infra error is probed (``GET /v1/tools``); if the probe fails it leaves the rotation, so
the calls that were in flight on it come back as typed ``infra_error`` results and later calls go
to the others. A server out of the rotation is probed again every ``retry_after_s`` and rejoins
when it answers. With no healthy server a call is an ``infra_error`` naming every server, never
an exception.

A server that answers a call with its overload refusal (503 ``overloaded``: nothing ran) is left
alone by that call for the wait the server asked for, and the call goes to another healthy server;
when every one is resting it waits for the first to be ready. Only a call whose own deadline passes
that way is an ``infra_error``, marked ``overloaded`` (:class:`osvl.tools.client.OverloadWaits`).
``take_restarts`` counts the servers that came back as a new process (their instance changed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools.client import OverloadWaits, RemoteToolPool
from osvl.tools.environment import ToolEnvironment
from osvl.tools.faults import FaultInjectingRunner
from osvl.tools.pool import Job, PoolStats


@dataclass
class _Member:
    url: str
    pool: RemoteToolPool
    in_flight: int = 0
    down_since: float | None = None
    calls: int = 0
    failures: list[str] = field(default_factory=list)


class ToolServerFleet:
    """``ToolPool``'s calling interface over several tool servers; ``close`` when done."""

    def __init__(
        self,
        urls: tuple[str, ...] | list[str],
        *,
        max_image_pixels: int = 24_000_000,
        retry_after_s: float = 5.0,
        probe_timeout_s: float = 5.0,
        max_concurrency: int = 64,
    ) -> None:
        if not urls:
            raise ValueError("a tool server fleet needs at least one URL")
        self.members = [_Member(u.rstrip("/"), RemoteToolPool(u, max_image_pixels)) for u in urls]
        self.retry_after_s, self.probe_timeout_s = retry_after_s, probe_timeout_s
        self.stats = PoolStats()
        self._restarts_taken = 0
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._probe = httpx.Client(trust_env=False, timeout=probe_timeout_s)
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="osvl-tool-fleet")

    def healthy(self, url: str) -> bool:
        """Whether ``url`` answers ``GET /v1/tools`` now."""
        try:
            return self._probe.get(f"{url}/v1/tools").status_code == 200
        except httpx.HTTPError:
            return False

    def tool_names(self, url: str) -> set[str]:
        """The tools a server exposes (pre-flight); ValueError naming the server when it cannot say."""
        try:
            response = self._probe.get(f"{url.rstrip('/')}/v1/tools")
            response.raise_for_status()
            return {schema["function"]["name"] for schema in response.json()}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"tool server {url}: GET /v1/tools failed: {error!r}") from None

    def _pick(self, waits: OverloadWaits) -> tuple[_Member | None, float]:
        """The healthy server to ask next and how long to wait first (0 unless every healthy server is
        resting after an overload answer to this call: then the first to be ready); None when none is up."""
        now = time.monotonic()
        with self._lock:
            retry = [m for m in self.members if m.down_since is not None and now - m.down_since >= self.retry_after_s]
            for member in retry:
                member.down_since = now  # one prober at a time
        for member in retry:
            if self.healthy(member.url):
                with self._lock:
                    member.down_since = None
        with self._lock:
            up = [m for m in self.members if m.down_since is None]
            if not up:
                return None, 0.0
            member = min(up, key=lambda m: (waits.ready_in(m.url), m.in_flight))
            return member, waits.ready_in(member.url)

    def call(self, job: Job) -> ToolResult:
        with self._lock:
            self.stats.submitted += 1
        waits = OverloadWaits(job, self._rng)
        while True:
            member, pause = self._pick(waits)
            if member is None:
                down = ", ".join(m.url for m in self.members)
                result = ToolResult(ToolStatus.INFRA_ERROR, job.tool, error=f"no healthy tool server ({down})")
                break
            if waits.passes_deadline(pause):
                result = waits.failure()
                break
            time.sleep(pause)
            with self._lock:
                member.in_flight += 1
                member.calls += 1
            try:
                outcome = member.pool.attempt(job, waits.end_to_end_s())
            finally:
                with self._lock:
                    member.in_flight -= 1
            if not isinstance(outcome, ToolResult):
                waits.refused(outcome)
                continue
            result = outcome
            if result.status is ToolStatus.INFRA_ERROR and not self.healthy(member.url):
                with self._lock:
                    if member.down_since is None:
                        member.down_since = time.monotonic()
                    member.failures.append(result.error or "")
                result = dataclasses.replace(result, error=f"{member.url}: {result.error}")
            break
        result.overloads = waits.answers
        with self._lock:
            self.stats.completed += 1
        return result

    def health(self) -> str:
        """Each server as the fleet last saw it: up (calls sent), or down for how long and its last failure."""
        now = time.monotonic()
        with self._lock:
            return ", ".join(
                f"{m.url} up ({m.calls} calls)"
                if m.down_since is None
                else f"{m.url} down for {now - m.down_since:.0f} s ({(m.failures or ['?'])[-1][:120]})"
                for m in self.members
            )

    def take_restarts(self) -> int:
        """Servers seen coming back as a new process since the last call (a tool server's restart)."""
        with self._lock:
            total = sum(m.pool.restarts for m in self.members)
            taken, self._restarts_taken = total - self._restarts_taken, total
        return taken

    async def acall(self, job: Job) -> ToolResult:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.call, job)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._probe.close()
        for member in self.members:
            member.pool.close()


def tool_fleet(env: ToolEnvironment) -> ToolServerFleet | None:
    """The tool servers behind ``env`` (under the fault injector when it wraps them); None for local workers."""
    runner = env.pool.runner if isinstance(env.pool, FaultInjectingRunner) else env.pool
    return runner if isinstance(runner, ToolServerFleet) else None
