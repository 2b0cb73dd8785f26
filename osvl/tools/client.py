"""The tool server's client: ``RemoteToolPool`` has the ``ToolPool`` calling interface, so a
``ToolEnvironment`` runs unchanged against a remote ``osvl.tools.server``. The client sends the images
its call references (resolved from its own visual context); the server looks the tool up in its own
registry (a client never names code to run).

Overload is back-pressure, not a failure: a saturated server answers 503 with kind ``overloaded``, a
``Retry-After`` header and, for a full queue, ``retry_after_s``, its estimate of when a queue slot frees.
Nothing ran, so the client asks again after that long (jittered, growing when no estimate came) until
the call's own deadline (``Job.end_to_end_s``, else ``Job.deadline_s``); only a call whose deadline
passes that way is an ``infra_error``, marked ``overloaded``. Every result says how many overload
answers its call met (``ToolResult.overloads``). ``osvl.tools.fleet`` does the same over several
servers, trying the others first.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from osvl.http_retry import retry_after_seconds
from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools.pool import Job, PoolStats
from osvl.tools.wire import INSTANCE_HEADER, dumps, encode_images, result_from_json

FIRST_OVERLOAD_WAIT_S = 0.05  # a client's wait after an overload answer without an estimate; doubles per answer
MAX_OVERLOAD_WAIT_S = 2.0


@dataclass(frozen=True)
class Overloaded:
    """A tool server's refusal for load (HTTP 503, kind ``overloaded``): nothing ran; ask again later."""

    url: str
    retry_after_s: float | None  # the server's estimate (body), else its Retry-After header; None: neither
    message: str


class OverloadWaits:
    """One call's waits on overloaded servers: when it may ask each again, and when its deadline passes."""

    def __init__(self, job: Job, rng: random.Random) -> None:
        self.job, self.rng = job, rng
        self.started = time.monotonic()
        self.budget_s = job.end_to_end_s if job.end_to_end_s is not None else job.deadline_s
        self.answers = 0
        self.last: Overloaded | None = None
        self._resting: dict[str, float] = {}  # url -> when this call may ask it again
        self._in_a_row: dict[str, int] = {}

    def refused(self, answer: Overloaded) -> None:
        """``answer`` came back: leave its server alone for its estimate (or a growing wait), jittered so
        the callers it refused together do not come back together."""
        self.answers += 1
        self.last = answer
        row = self._in_a_row[answer.url] = self._in_a_row.get(answer.url, 0) + 1
        wait = answer.retry_after_s
        if wait is None:
            wait = min(FIRST_OVERLOAD_WAIT_S * 2 ** (row - 1), MAX_OVERLOAD_WAIT_S)
        self._resting[answer.url] = time.monotonic() + wait * self.rng.uniform(1.0, 2.0)

    def ready_in(self, url: str) -> float:
        return max(0.0, self._resting.get(url, 0.0) - time.monotonic())

    def passes_deadline(self, wait_s: float) -> bool:
        return time.monotonic() + wait_s >= self.started + self.budget_s

    def end_to_end_s(self) -> float | None:
        """What is left of the job's end-to-end deadline (None when it has none)."""
        if self.job.end_to_end_s is None:
            return None
        return max(self.job.end_to_end_s - (time.monotonic() - self.started), 1e-3)

    def failure(self) -> ToolResult:
        """The ``infra_error`` of a call whose deadline passed while every server it could ask was overloaded."""
        last = f"; last: {self.last.url}: {self.last.message}" if self.last else ""
        return ToolResult(
            ToolStatus.INFRA_ERROR,
            self.job.tool,
            error=f"tool servers overloaded for the call's whole {self.budget_s:g}s deadline "
            f"({self.answers} overload answers{last})",
            elapsed_s=time.monotonic() - self.started,
            overloads=self.answers,
            overloaded=True,
        )


class RemoteToolPool:
    """``ToolPool``'s calling interface over HTTP; transport failures become ``infra_error``, overload
    answers are waited out within the call's deadline."""

    def __init__(
        self,
        url: str,
        max_image_pixels: int = 24_000_000,
        grace_s: float = 10.0,
        max_image_bytes: int | None = 32 << 20,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_image_pixels, self.max_image_bytes = max_image_pixels, max_image_bytes
        self.grace_s = grace_s  # transport allowance on top of the call's deadline
        self.stats = PoolStats()
        self.instance: str | None = None  # the server process answering (its X-Tool-Server-Instance)
        self.restarts = 0  # times the instance changed: the server was restarted
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._client = httpx.Client(trust_env=False)

    def call(self, job: Job) -> ToolResult:
        with self._lock:
            self.stats.submitted += 1
        waits = OverloadWaits(job, self._rng)
        while True:
            outcome = self.attempt(job, waits.end_to_end_s())
            if isinstance(outcome, ToolResult):
                break
            waits.refused(outcome)
            pause = waits.ready_in(self.url)
            if waits.passes_deadline(pause):
                outcome = waits.failure()
                break
            time.sleep(pause)
        outcome.overloads = waits.answers
        with self._lock:
            self.stats.completed += 1
        return outcome

    def attempt(self, job: Job, end_to_end_s: float | None) -> ToolResult | Overloaded:
        """One request: the call's result (transport failures as ``infra_error``), or the server's overload
        answer, which leaves the next move to the caller."""
        started = time.monotonic()
        body = {
            "tool": job.tool,
            "arguments": job.arguments,
            "images": encode_images(job.images),
            "deadline_s": job.deadline_s,
        }
        budget = job.deadline_s + self.grace_s
        if end_to_end_s is not None:
            body["end_to_end_s"] = end_to_end_s
            budget = min(budget, end_to_end_s + self.grace_s)
        try:
            response = self._client.post(
                f"{self.url}/v1/call",
                content=dumps(body),
                headers={"content-type": "application/json"},
                timeout=budget,
            )
            self._note_instance(response.headers.get(INSTANCE_HEADER))
            overloaded = _overload_answer(self.url, response)
            if overloaded is not None:
                return overloaded
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
            result = result_from_json(response.json(), self.max_image_pixels, self.max_image_bytes)
            result.worker = f"{self.url} {result.worker}".strip()
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            result = ToolResult(
                ToolStatus.INFRA_ERROR,
                job.tool,
                error=f"tool server failed: {err}",
                elapsed_s=time.monotonic() - started,
            )
        return result

    def _note_instance(self, instance: str | None) -> None:
        if not instance:
            return
        with self._lock:
            if self.instance is not None and instance != self.instance:
                self.restarts += 1
            self.instance = instance

    async def acall(self, job: Job) -> ToolResult:
        return await asyncio.to_thread(self.call, job)

    def tool_schemas(self) -> list[dict[str, Any]]:
        response = self._client.get(f"{self.url}/v1/tools", timeout=30)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


def _overload_answer(url: str, response: httpx.Response) -> Overloaded | None:
    """The server's typed overload answer (503, kind ``overloaded``), or None for any other response."""
    if response.status_code != 503:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("kind") != "overloaded":
        return None
    estimate = body.get("retry_after_s")
    if isinstance(estimate, (int, float)) and not isinstance(estimate, bool) and math.isfinite(estimate):
        wait = max(float(estimate), 0.0)
    else:
        wait = retry_after_seconds(response.headers.get("retry-after"))
    return Overloaded(url, wait, str(body.get("error", ""))[:200])
