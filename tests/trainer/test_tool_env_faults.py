"""Injected tool faults are a function of the call, not of timing: the same calls finishing in any
order are faulted alike, at the configured rate, and only successful calls are ever faulted.
Back-end outages are a function of the rollout: one window of turns per hit rollout, every call to
the down tools inside it an infra_error, reproducible across runs and resumes."""

from __future__ import annotations

import asyncio
import math
from itertools import product

import pytest

from osvl.config import load_recipe
from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools import Job, ToolEnvironment
from osvl.tools.environment import CallIdentity, current_call
from osvl.tools.faults import INJECTED, FaultInjectingRunner, OutageModel, fault_draw
from osvl.trainer.tool_env import recipe_outages, step_faults

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


def _job(n: int, tool: str = "echo") -> Job:
    return Job(tool=tool, target="unused:unused", arguments={"n": n}, deadline_s=20.0)


def _run_concurrently(runner: FaultInjectingRunner) -> dict[CallIdentity, ToolResult]:
    async def one(n: int, call: CallIdentity) -> tuple[CallIdentity, ToolResult]:
        current_call.set(call)  # each task has its own copy of the context, as each trajectory does
        return call, await runner.acall(_job(n))

    async def run() -> list[tuple[CallIdentity, ToolResult]]:
        return await asyncio.gather(*(one(n, call) for n, call in enumerate(CALLS)))

    return dict(asyncio.run(run()))


def _sync_call(runner: FaultInjectingRunner, call: CallIdentity, n: int = 0, tool: str = "echo") -> ToolResult:
    token = current_call.set(call)
    try:
        return runner.call(_job(n, tool))
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
    others = [
        fault_draw(6, CallIdentity(1, 2, 3)),
        fault_draw(5, CallIdentity(0, 2, 3)),
        fault_draw(5, CallIdentity(1, 0, 3)),
        fault_draw(5, CallIdentity(1, 2, 0)),
        fault_draw(5, CallIdentity(12, 3, 3)),
    ]  # no collision from joining the numbers
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

    def decisions(e):
        return [fault_draw(e.pool.seed, c) < e.pool.rate for c in CALLS]

    first = step_faults(env, seed=0, step=3, rank=0)
    assert first.pool.runner is env.pool.runner and first.pool.rate == 0.5 and first is not env
    assert decisions(step_faults(env, seed=0, step=3, rank=0)) == decisions(first)  # a resumed run at step 3
    assert decisions(step_faults(env, seed=0, step=4, rank=0)) != decisions(first)
    assert decisions(step_faults(env, seed=0, step=3, rank=1)) != decisions(first)
    assert decisions(step_faults(env, seed=1, step=3, rank=0)) != decisions(first)
    plain = ToolEnvironment(registry=None, pool=DelayedRunner({}))
    assert step_faults(plain, seed=0, step=3, rank=0) is plain  # no faults configured: untouched


# --- correlated back-end outages ---------------------------------------------------------------

ROLLOUTS = list(product(range(200), range(8)))


def test_outages_hit_the_configured_share_of_rollouts_from_a_uniform_start_to_the_end():
    model = OutageModel(rate=0.3, start_turns=4)
    windows = [model.window(7, g, s) for g, s in ROLLOUTS]
    hit = [w for w in windows if w is not None]
    assert abs(len(hit) / len(ROLLOUTS) - 0.3) < 0.04
    starts = [w[0] for w in hit]
    assert set(starts) == {0, 1, 2, 3} and all(abs(starts.count(t) / len(hit) - 0.25) < 0.06 for t in range(4))
    assert all(end == math.inf for _, end in hit)
    assert [model.window(7, g, s) for g, s in ROLLOUTS] == windows  # a rerun or a resume meets the same outages
    assert [model.window(8, g, s) for g, s in ROLLOUTS] != windows
    assert OutageModel(rate=0.0).window(7, 0, 0) is None and all(
        OutageModel(rate=1.0).window(7, g, s) is not None for g, s in ROLLOUTS[:50]
    )


def test_outage_durations_are_geometric_with_the_configured_mean():
    model = OutageModel(rate=1.0, start_turns=1, mean_turns=3.0)
    durations = [model.window(1, g, s)[1] for g, s in product(range(1000), range(8))]
    assert min(durations) == 1 and abs(sum(durations) / len(durations) - 3.0) < 0.15
    share_one = durations.count(1) / len(durations)
    assert abs(share_one - 1 / 3) < 0.03  # P(D = 1) = 1 / mean
    assert {
        OutageModel(rate=1.0, mean_turns=1.0).window(1, g, 0)[1]
        - OutageModel(rate=1.0, mean_turns=1.0).window(1, g, 0)[0]
        for g in range(50)
    } == {1}


def test_an_outage_answers_every_call_to_the_down_tools_in_its_window_without_running_them():
    inner = DelayedRunner({})
    model = OutageModel(rate=1.0, start_turns=3, mean_turns=0.0, tools=("text_search",))
    runner = FaultInjectingRunner(inner, 0.0, seed=4, outages=model)
    start, _ = model.window(4, 0, 0)
    results = {t: _sync_call(runner, CallIdentity(0, 0, t), tool="text_search") for t in range(6)}
    assert all(results[t].ok for t in range(start))
    down = [results[t] for t in range(start, 6)]
    assert all(r.status is ToolStatus.INFRA_ERROR and r.tool == "text_search" for r in down)
    assert inner.calls == start and runner.outage_errors == 6 - start and runner.injected == 0
    other = _sync_call(runner, CallIdentity(0, 0, 5), tool="crop")
    assert other.ok  # a local tool is served while the search provider is down


def test_outage_errors_look_like_a_failing_provider():
    runner = FaultInjectingRunner(DelayedRunner({}), 0.0, seed=2, outages=OutageModel(rate=1.0, start_turns=1))
    errors = [_sync_call(runner, CallIdentity(g, 0, t), tool="image_search").error for g in range(40) for t in range(3)]
    assert any("HTTP 503" in e for e in errors) and any("HTTP 429" in e for e in errors)
    assert any("did not answer within 20s" in e for e in errors)
    assert all(e.startswith("image_search back-end") for e in errors)


def test_outages_and_independent_faults_coexist_and_are_order_free():
    calls = [CallIdentity(g, s, t) for g, s, t in product(range(6), range(4), range(4))]
    model = OutageModel(rate=0.5, start_turns=2)

    def run(delays):
        runner = FaultInjectingRunner(DelayedRunner(delays), 0.2, seed=9, outages=model)

        async def one(call):
            current_call.set(call)
            return call, await runner.acall(_job(0, "text_search"))

        async def all_calls():
            return await asyncio.gather(*(one(c) for c in calls))

        return {c: (r.status, r.error) for c, r in asyncio.run(all_calls())}

    forward = run({c: 0.0005 * i for i, c in enumerate(calls)})
    backward = run({c: 0.0005 * (len(calls) - i) for i, c in enumerate(calls)})
    assert forward == backward
    statuses = [s for s, _ in forward.values()]
    assert ToolStatus.INFRA_ERROR in statuses and ToolStatus.TOOL_ERROR in statuses and ToolStatus.OK in statuses


def test_step_faults_keep_the_outage_model():
    model = OutageModel(rate=0.4)
    env = ToolEnvironment(registry=None, pool=FaultInjectingRunner(DelayedRunner({}), 0.0, seed=0, outages=model))
    stepped = step_faults(env, seed=0, step=5, rank=0)
    assert stepped.pool.outages is model and stepped.pool.seed != env.pool.seed

    def windows(e):
        return [e.pool.outages.window(e.pool.seed, g, s) for g, s in ROLLOUTS[:64]]

    assert windows(step_faults(env, seed=0, step=5, rank=0)) == windows(stepped)  # resumed at step 5
    assert windows(step_faults(env, seed=0, step=6, rank=0)) != windows(stepped)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 1.2}, "outage rate"),
        ({"start_turns": 0}, "start_turns"),
        ({"mean_turns": 0.5}, "mean_turns"),
        ({"rate": 0.1, "tools": ()}, "tools whose back-end"),
    ],
)
def test_bad_outage_models_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OutageModel(**kwargs)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tools.outage_rate=-0.1", "tools: outage_rate"),
        ("tools.outage_mean_turns=0.5", "tools: outage_mean_turns"),
        ("tools.outage_start_turns=0", "tools: outage_start_turns"),
        ("tools.outage_tools=[]", "tools: outage_rate > 0 needs outage_tools"),
    ],
)
def test_bad_outage_recipes_name_the_key(override, message):
    extra = ["tools.outage_rate=0.2"] if "outage_tools" in override else []
    with pytest.raises(ValueError, match=message):
        load_recipe("tiny_grpo", [override, *extra])


def test_the_recipe_builds_the_outage_model():
    recipe = load_recipe(
        "tiny_grpo", ["tools.outage_rate=0.3", "tools.outage_mean_turns=2", 'tools.outage_tools=["text_search"]']
    )
    assert recipe_outages(recipe) == OutageModel(rate=0.3, start_turns=4, mean_turns=2.0, tools=("text_search",))
