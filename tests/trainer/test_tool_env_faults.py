"""Injected tool faults are a function of the call, not of timing: the same calls finishing in any
order are faulted alike, at the configured rate, and only successful calls are ever faulted."""

from __future__ import annotations

import asyncio
from itertools import product

import pytest

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.rollout.agent import CallIdentity, current_call
from osvl.tools import Job, ToolEnvironment
from osvl.trainer.tool_env import INJECTED, FaultInjectingRunner, fault_draw, step_faults

CALLS = [CallIdentity(g, s, t) for g, s, t in product(range(4), range(4), range(3))]


class DelayedRunner:
    """Answers each call after its own delay, so the completion order is whatever the delays make it."""

    def __init__(self, delays: dict[CallIdentity, float], status: ToolStatus = ToolStatus.OK) -> None:
        self.delays, self.status = delays, status
        self.finished: list[CallIdentity] = []
        self.calls = 0

    def _answer(self, job: Job) -> ToolResult:
        self.calls += 1
        self.finished.append(current_call.get())
        error = None if self.status is ToolStatus.OK else "failed for real"
        return ToolResult(status=self.status, tool=job.tool, text=f"done {job.arguments['n']}", error=error)

    def call(self, job: Job) -> ToolResult:
        return self._answer(job)

    async def acall(self, job: Job) -> ToolResult:
        await asyncio.sleep(self.delays[current_call.get()])
        return self._answer(job)


def _job(n: int) -> Job:
    return Job(tool="echo", target="unused:unused", arguments={"n": n})


def _run_concurrently(runner: FaultInjectingRunner) -> dict[CallIdentity, ToolResult]:
    async def one(n: int, call: CallIdentity) -> tuple[CallIdentity, ToolResult]:
        current_call.set(call)  # each task has its own copy of the context, as each trajectory does
        return call, await runner.acall(_job(n))

    async def run() -> list[tuple[CallIdentity, ToolResult]]:
        return await asyncio.gather(*(one(n, call) for n, call in enumerate(CALLS)))

    return dict(asyncio.run(run()))


def _sync_call(runner: FaultInjectingRunner, call: CallIdentity, n: int = 0) -> ToolResult:
    token = current_call.set(call)
    try:
        return runner.call(_job(n))
    finally:
        current_call.reset(token)


def test_faults_do_not_depend_on_completion_order():
    forward = DelayedRunner({c: 0.001 * i for i, c in enumerate(CALLS)})
    backward = DelayedRunner({c: 0.001 * (len(CALLS) - i) for i, c in enumerate(CALLS)})
    a, b = FaultInjectingRunner(forward, 0.3, seed=7), FaultInjectingRunner(backward, 0.3, seed=7)
    first, second = _run_concurrently(a), _run_concurrently(b)
    assert forward.finished != backward.finished  # the two runs really finished in different orders
    decisions = {c: r.status for c, r in first.items()}
    assert decisions == {c: r.status for c, r in second.items()}
    faulted = [c for c, s in decisions.items() if s is ToolStatus.TOOL_ERROR]
    assert 0 < len(faulted) < len(CALLS)
    assert a.injected == b.injected == len(faulted)
    assert all(first[c].error == INJECTED and first[c].text == "" for c in faulted)
    assert faulted == [c for c in CALLS if fault_draw(7, c) < 0.3]


def test_each_call_is_faulted_with_probability_rate():
    rate, n = 0.3, 20_000
    draws = [fault_draw(11, CallIdentity(g, s, t)) for g, s, t in product(range(n // 40), range(8), range(5))]
    assert len(draws) == n and all(0.0 <= u < 1.0 for u in draws)
    realised = sum(u < rate for u in draws) / n
    assert abs(realised - rate) < 0.02, realised  # ~6 standard deviations; the seed makes it fixed anyway
    assert abs(sum(draws) / n - 0.5) < 0.02


def test_the_runner_faults_at_the_rate_and_counts_what_it_injected():
    runner = FaultInjectingRunner(DelayedRunner({}), 0.25, seed=3)
    calls = [CallIdentity(g, s, t) for g, s, t in product(range(50), range(8), range(5))]
    statuses = [_sync_call(runner, c).status for c in calls]
    injected = statuses.count(ToolStatus.TOOL_ERROR)
    assert runner.injected == injected and abs(injected / len(calls) - 0.25) < 0.04


def test_failures_are_never_converted_and_the_extremes_hold():
    failing = FaultInjectingRunner(DelayedRunner({}, ToolStatus.TIMEOUT), 1.0, seed=0)
    assert all(_sync_call(failing, c).status is ToolStatus.TIMEOUT for c in CALLS) and failing.injected == 0
    always = FaultInjectingRunner(DelayedRunner({}), 1.0, seed=0)
    never = FaultInjectingRunner(DelayedRunner({}), 0.0, seed=0)
    assert all(_sync_call(always, c).error == INJECTED for c in CALLS) and always.injected == len(CALLS)
    assert all(_sync_call(never, c).ok for c in CALLS) and never.injected == 0


def test_the_draw_depends_on_every_part_of_the_identity_and_the_seed():
    base = fault_draw(5, CallIdentity(1, 2, 3))
    assert base == fault_draw(5, CallIdentity(1, 2, 3))
    others = [fault_draw(6, CallIdentity(1, 2, 3)), fault_draw(5, CallIdentity(0, 2, 3)),
              fault_draw(5, CallIdentity(1, 0, 3)), fault_draw(5, CallIdentity(1, 2, 0)),
              fault_draw(5, CallIdentity(12, 3, 3))]  # no collision from joining the numbers
    assert base not in others and len(set(others)) == len(others)


def test_a_call_without_identity_is_refused_before_it_runs():
    inner = DelayedRunner({})
    runner = FaultInjectingRunner(inner, 0.5, seed=0)
    with pytest.raises(ValueError, match="identity of the tool call"):
        runner.call(_job(0))
    with pytest.raises(ValueError, match="identity of the tool call"):
        asyncio.run(runner.acall(_job(0)))
    assert inner.calls == 0


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_bad_rates_are_rejected(rate):
    with pytest.raises(ValueError, match="fault rate"):
        FaultInjectingRunner(DelayedRunner({}), rate, seed=0)


def test_step_faults_reseed_by_step_and_rank_not_history():
    env = ToolEnvironment(registry=None, pool=FaultInjectingRunner(DelayedRunner({}), 0.5, seed=0))
    decisions = lambda e: [fault_draw(e.pool.seed, c) < e.pool.rate for c in CALLS]
    first = step_faults(env, seed=0, step=3, rank=0)
    assert first.pool.runner is env.pool.runner and first.pool.rate == 0.5 and first is not env
    assert decisions(step_faults(env, seed=0, step=3, rank=0)) == decisions(first)  # a resumed run at step 3
    assert decisions(step_faults(env, seed=0, step=4, rank=0)) != decisions(first)
    assert decisions(step_faults(env, seed=0, step=3, rank=1)) != decisions(first)
    assert decisions(step_faults(env, seed=1, step=3, rank=0)) != decisions(first)
    plain = ToolEnvironment(registry=None, pool=DelayedRunner({}))
    assert step_faults(plain, seed=0, step=3, rank=0) is plain  # no faults configured: untouched
