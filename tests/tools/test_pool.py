"""Fault tests: hangs, aborts and leaks cost one call, never the pool, and never mix up callers."""

import asyncio
import time

import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import Job, PoolBusy, PoolClosed, PoolConfig, ToolBackendsConfig, ToolPool
from tests.tools.conftest import LEAK_LIMIT_BYTES

T = "tests.tools.fault_tools:"


def job(fn, deadline_s=10.0, **arguments):
    images = arguments.pop("images", [])
    return Job(tool=fn, target=T + fn, arguments=arguments, images=images, deadline_s=deadline_s)


def test_concurrent_callers_get_their_own_results(fault_pool):
    async def run():
        jobs = [
            job("echo", tag=f"caller{i}", seconds=0.01 * (i % 3), images=[np.full((3, 4, 3), i, np.uint8)])
            for i in range(12)
        ]
        return await asyncio.gather(*(fault_pool.acall(j) for j in jobs))

    results = asyncio.run(run())
    for i, result in enumerate(results):
        assert result.status is ToolStatus.OK, result.error
        assert result.text.startswith(f"echo:caller{i}:")
        assert result.images[0].shape == (3, 4, 3) and np.all(result.images[0] == i + 1)
        assert result.elapsed_s > 0


def test_hang_times_out_and_the_worker_is_replaced(fault_pool):
    before = fault_pool.stats.timeouts
    result = fault_pool.call(job("hang", deadline_s=0.3))
    assert result.status is ToolStatus.TIMEOUT
    assert "did not finish within 0.3s" in result.error
    assert 0.3 <= result.elapsed_s < 5
    assert fault_pool.stats.timeouts == before + 1
    assert fault_pool.call(job("echo", tag="after")).text.startswith("echo:after:")


def test_abort_is_an_infra_error_and_the_pool_keeps_serving(fault_pool):
    before = fault_pool.stats.crashes
    result = fault_pool.call(job("abort"))
    assert result.status is ToolStatus.INFRA_ERROR
    assert "died" in result.error and "exit code -6" in result.error
    assert fault_pool.stats.crashes == before + 1
    give_up = time.monotonic() + 60
    while None in fault_pool.worker_pids and time.monotonic() < give_up:  # replaced in the background
        time.sleep(0.05)
    assert None not in fault_pool.worker_pids
    assert fault_pool.call(job("echo", tag="alive")).status is ToolStatus.OK


def test_memory_leak_is_stopped_by_the_rss_watchdog(fault_pool):
    result = fault_pool.call(job("leak", deadline_s=30))
    assert result.status is ToolStatus.INFRA_ERROR
    assert f"over the {LEAK_LIMIT_BYTES >> 20} MiB limit" in result.error
    assert fault_pool.stats.memory_kills >= 1
    assert fault_pool.call(job("echo", tag="x")).status is ToolStatus.OK


def test_faults_next_to_healthy_callers_lose_and_mix_nothing(fault_pool):
    async def run():
        calls = []
        for i in range(8):
            if i == 2:
                calls.append(job("abort"))
            elif i == 5:
                calls.append(job("hang", deadline_s=0.3))
            else:
                calls.append(job("echo", tag=f"h{i}", images=[np.full((2, 2, 3), i, np.uint8)]))
        return calls, await asyncio.gather(*(fault_pool.acall(c) for c in calls))

    calls, results = asyncio.run(run())
    assert len(results) == len(calls)
    for i, (call, result) in enumerate(zip(calls, results, strict=True)):
        assert result.tool == call.tool
        if call.tool == "echo":
            assert result.status is ToolStatus.OK and result.text.startswith(f"echo:h{i}:")
            assert np.all(result.images[0] == i + 1)
        elif call.tool == "abort":
            assert result.status is ToolStatus.INFRA_ERROR
        else:
            assert result.status is ToolStatus.TIMEOUT


@pytest.mark.parametrize(
    "fn, status, message",
    [
        ("refuse", ToolStatus.TOOL_ERROR, "the model can fix"),
        ("backend_down", ToolStatus.INFRA_ERROR, "upstream service unavailable"),
        ("buggy", ToolStatus.INFRA_ERROR, "KeyError"),
        ("bad_image", ToolStatus.INFRA_ERROR, "invalid image"),
        ("no_such_function", ToolStatus.INFRA_ERROR, "AttributeError"),
    ],
)
def test_exceptions_map_to_statuses(fault_pool, fn, status, message):
    result = fault_pool.call(job(fn))
    assert result.status is status and message in result.error


def test_back_pressure_on_a_full_queue(fault_pool):
    # Long enough that the workers stay busy through the checks even on a loaded machine.
    busy = [fault_pool.submit(job("echo", tag="slow", seconds=3.0)) for _ in range(2)]
    while not all(f.running() or f.done() for f in busy):  # both workers have taken a job
        time.sleep(0.01)
    queued = [fault_pool.submit(job("echo", tag=f"q{i}"), block=False) for i in range(4)]
    with pytest.raises(PoolBusy, match="queue is full"):
        fault_pool.submit(job("echo"), block=False)
    with pytest.raises(PoolBusy):
        fault_pool.submit(job("echo"), timeout=0.05)
    assert [f.result().text.split(":")[1] for f in queued] == ["q0", "q1", "q2", "q3"]
    assert all(f.result().status is ToolStatus.OK for f in busy)


def test_async_callers_wait_for_queue_space(fault_pool):
    async def run():
        return await asyncio.gather(*(fault_pool.acall(job("echo", tag=f"a{i}")) for i in range(10)))

    results = asyncio.run(run())  # 10 jobs through a queue of 4: acall must wait, not fail
    assert [r.text.split(":")[1] for r in results] == [f"a{i}" for i in range(10)]


def test_address_space_limit_turns_a_huge_allocation_into_infra_error_and_close():
    config = PoolConfig(num_workers=1, max_queue=2, max_rss_bytes=None, address_space_bytes=6 << 30)
    pool = ToolPool(ToolBackendsConfig(), config)
    try:
        pid = pool.worker_pids[0]
        result = pool.call(job("huge_allocation"))
        assert result.status is ToolStatus.INFRA_ERROR and "out of memory" in result.error
        assert pool.call(job("echo", tag="fresh")).status is ToolStatus.OK
        assert pool.worker_pids[0] != pid  # the worker that hit its limit was retired
        assert pool.stats.restarts >= 1
    finally:
        pool.close()
    with pytest.raises(PoolClosed):
        pool.submit(job("echo"))
    assert pool.worker_pids == [None]


def test_bad_pool_and_job_configs():
    with pytest.raises(ValueError, match="num_workers"):
        PoolConfig(num_workers=0)
    with pytest.raises(ValueError, match="watch_interval_s"):
        PoolConfig(watch_interval_s=0)
    with pytest.raises(ValueError, match="opencv_threads"):
        PoolConfig(opencv_threads=0)
    with pytest.raises(ValueError, match="max_rss_bytes"):
        PoolConfig(max_rss_bytes=-1)
    with pytest.raises(ValueError, match="deadline_s"):
        job("echo", deadline_s=float("nan"))


def test_a_pool_whose_workers_cannot_start_fails_loudly():
    with pytest.raises(RuntimeError, match="failed to start"):
        ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=1, startup_timeout_s=0.001))


def test_time_in_the_queue_does_not_count_against_the_deadline(fault_pool):
    blockers = [fault_pool.submit(job("echo", tag="slow", seconds=0.5)) for _ in range(2)]
    waiting = [fault_pool.submit(job("echo", tag=f"w{i}", seconds=0.05, deadline_s=0.3)) for i in range(2)]
    assert [f.result().status for f in waiting] == [ToolStatus.OK, ToolStatus.OK]
    assert all(f.result().status is ToolStatus.OK for f in blockers)


def test_results_record_queue_and_run_seconds_and_the_worker(fault_pool):
    result = fault_pool.call(job("echo", tag="who", seconds=0.05))
    assert result.status is ToolStatus.OK
    pid = int(result.text.rsplit("pid=", 1)[1])
    assert result.worker == f"pid {pid}" and pid in fault_pool.worker_pids
    assert result.run_s >= 0.05 and result.queue_s >= 0.0
    assert result.elapsed_s == pytest.approx(result.queue_s + result.run_s)


def test_the_specs_options_reach_the_implementation():
    with ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=1)) as pool:
        result = pool.call(Job("echo_options", T + "echo_options", {}, options={"limit": 3, "mode": "x"}))
    assert result.status is ToolStatus.OK and result.text == '{"limit": 3, "mode": "x"}'


def test_an_end_to_end_deadline_counts_the_queue_and_is_ours_when_the_queue_spends_it():
    with ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=1, max_queue=8)) as pool:
        blocker = pool.submit(job("echo", seconds=1.0))
        starved = pool.submit(Job("echo", T + "echo", {}, deadline_s=5.0, end_to_end_s=0.3))
        squeezed = pool.submit(Job("echo", T + "echo", {"seconds": 4.0}, deadline_s=5.0, end_to_end_s=2.5))
        own = pool.submit(Job("echo", T + "echo", {"seconds": 2.0}, deadline_s=0.5, end_to_end_s=30.0))
        assert blocker.result().status is ToolStatus.OK
        starved, squeezed, own = starved.result(), squeezed.result(), own.result()
    assert starved.status is ToolStatus.INFRA_ERROR and "end-to-end deadline of 0.3s passed" in starved.error
    assert starved.queue_s >= 0.3 and starved.worker == "" and starved.run_s < 0.1
    assert squeezed.status is ToolStatus.INFRA_ERROR and "could not finish within its end-to-end" in squeezed.error
    assert squeezed.queue_s >= 0.9 and squeezed.run_s < 4.0  # cut by what the queue left, not by its own 5 s
    assert own.status is ToolStatus.TIMEOUT  # its own deadline ran out first: the policy's call was too slow
    with pytest.raises(ValueError, match="end_to_end_s"):
        Job("echo", T + "echo", {}, end_to_end_s=0.0)
