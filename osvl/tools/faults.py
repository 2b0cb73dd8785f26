"""Seeded tool failures for the demo, the tests and the fatal-mode ablation: independent per-call
faults and correlated back-end outages, wrapped around any tool runner.

Every decision is a function of a seed and the call's :class:`~osvl.tools.environment.CallIdentity`
(set by the agent loop), never of the order calls finish in, so runs and resumes meet the same
failures.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools.environment import CallIdentity, ToolRunner, current_call
from osvl.tools.pool import Job

INJECTED = "injected fault"
OUTAGE_KINDS = ("http_503", "http_429", "timeout")


def _uniform(key: str) -> float:
    """A uniform number in [0, 1) fixed by ``key`` (blake2b, so the same on every machine and Python,
    unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


def fault_draw(seed: int, call: CallIdentity) -> float:
    """The uniform draw that decides whether one call is faulted: fixed by the fault seed and the call's identity."""
    return _uniform(f"{seed}/{call.group_id}/{call.sample_index}/{call.turn}")


@dataclass(frozen=True)
class OutageModel:
    """Correlated back-end outages: how a real API outage reaches the agent.

    Per rollout, with probability ``rate`` the back-end serving ``tools`` goes down at a turn drawn
    uniformly from ``[0, start_turns)`` and stays down for ``mean_turns`` turns on average (a
    geometric duration, the memoryless choice; ``0`` = until the rollout ends). Every call to those
    tools in that window answers as the online back-ends do when their provider fails: HTTP 503,
    HTTP 429 or no answer before the deadline, each typed ``infra_error`` (``osvl.tools.http_client``
    types them the same way). A down back-end does no work, so the call is not run. Unlike
    independent faults (a cascade of K at ``rate**K``), an outage that begins after a good first
    call makes the K-consecutive rule fire on a rollout whose prefix was sound.

    Every draw is a function of the seed and the rollout's (group, sample) or the call's identity,
    so runs and resumes meet the same outages whatever order calls finish in.
    """

    rate: float = 0.0
    start_turns: int = 4
    mean_turns: float = 0.0
    tools: tuple[str, ...] = ("text_search", "image_search")

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"outage rate must lie in [0, 1], got {self.rate}")
        if self.start_turns < 1:
            raise ValueError(f"outage start_turns must be >= 1, got {self.start_turns}")
        if self.mean_turns != 0.0 and not self.mean_turns >= 1.0:
            raise ValueError(f"outage mean_turns must be 0 (to the rollout's end) or >= 1, got {self.mean_turns}")
        if self.rate > 0.0 and not self.tools:
            raise ValueError("an outage rate > 0 needs the tools whose back-end goes down")

    def window(self, seed: int, group_id: int, sample_index: int) -> tuple[int, float] | None:
        """``(first turn, end turn)`` of this rollout's outage (end exclusive, ``inf`` = to its end), or None."""
        key = f"{seed}/outage/{group_id}/{sample_index}"
        if _uniform(f"{key}/hit") >= self.rate:
            return None
        start = int(_uniform(f"{key}/start") * self.start_turns)
        if self.mean_turns == 0.0:
            return start, math.inf
        stop = 1.0 / self.mean_turns  # a geometric duration >= 1 with this mean, by inverting its CDF
        u = _uniform(f"{key}/duration")
        duration = 1 if stop >= 1.0 else 1 + int(math.log1p(-u) / math.log1p(-stop))
        return start, start + duration

    def hits(self, seed: int, call: CallIdentity, tool: str) -> bool:
        if self.rate == 0.0 or tool not in self.tools:
            return False
        window = self.window(seed, call.group_id, call.sample_index)
        return window is not None and window[0] <= call.turn < window[1]

    @staticmethod
    def result(seed: int, call: CallIdentity, tool: str, deadline_s: float) -> ToolResult:
        """What the agent sees from a down back-end: one of 503, 429 or a timeout, drawn per call."""
        kind = OUTAGE_KINDS[int(_uniform(f"{seed}/outage-kind/{call.group_id}/{call.sample_index}/{call.turn}") * 3)]
        error = {
            "http_503": f"{tool} back-end failed with HTTP 503 (Service Unavailable)",
            "http_429": f"{tool} back-end rate-limited the call (HTTP 429 Too Many Requests)",
            "timeout": f"{tool} back-end did not answer within {deadline_s:g}s",
        }[kind]
        return ToolResult(status=ToolStatus.INFRA_ERROR, tool=tool, error=error)


class FaultInjectingRunner:
    """Injects seeded tool failures: independent faults and correlated back-end outages.

    Independent faults turn a fraction ``rate`` of successful results into ``tool_error`` (a
    policy-counted error); they hit finished calls, so the worker pool, deadlines and images are
    exercised as usual, and K consecutive faults (a fatal cascade) happen at rate**K. Outages
    (``outages``, see :class:`OutageModel`) answer every call to a down back-end with an
    ``infra_error`` for a stretch of turns of one rollout. Every decision depends only on ``seed`` and
    the call's ``CallIdentity`` (set by the agent loop), never on the order calls finish in, so
    concurrent rollouts meet the same failures run after run.
    """

    def __init__(self, runner: ToolRunner, rate: float, seed: int, outages: OutageModel = OutageModel()) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must lie in [0, 1], got {rate}")
        self.runner, self.rate, self.seed, self.outages = runner, rate, seed, outages
        self.injected = 0
        self.outage_errors = 0

    @staticmethod
    def _identity() -> CallIdentity:
        call = current_call.get()
        if call is None:
            raise ValueError(
                "fault injection needs the identity of the tool call: run calls through the agent loop "
                "(osvl.rollout.run_trajectory) or set osvl.tools.environment.current_call"
            )
        return call

    def _maybe_fault(self, result: ToolResult, call: CallIdentity) -> ToolResult:
        if not result.ok or fault_draw(self.seed, call) >= self.rate:
            return result
        self.injected += 1
        return ToolResult(
            status=ToolStatus.TOOL_ERROR,
            tool=result.tool,
            error=INJECTED,
            elapsed_s=result.elapsed_s,
            overloads=result.overloads,
        )

    def _outage(self, job: Job, call: CallIdentity) -> ToolResult | None:
        if not self.outages.hits(self.seed, call, job.tool):
            return None
        self.outage_errors += 1
        return self.outages.result(self.seed, call, job.tool, job.deadline_s)

    def call(self, job: Job) -> ToolResult:
        call = self._identity()
        down = self._outage(job, call)
        return down if down is not None else self._maybe_fault(self.runner.call(job), call)

    async def acall(self, job: Job) -> ToolResult:
        call = self._identity()
        down = self._outage(job, call)
        return down if down is not None else self._maybe_fault(await self.runner.acall(job), call)
