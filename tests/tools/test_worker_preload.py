"""Preloaded targets: a tool's import is the pool's start-up time, never a call's deadline, and a
target that cannot be imported answers each of its calls with the import's error, costing nothing else."""

from __future__ import annotations

import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import Job, PoolConfig, ToolBackendsConfig, ToolPool
from osvl.tools.worker import preload_targets, resolve_target, run_job
from tests.tools.slow_import_tool import IMPORT_SECONDS

SLOW = "tests.tools.slow_import_tool:answer"
ECHO = "tests.tools.fault_tools:echo"
HANG = "tests.tools.fault_tools:hang"
MISSING_MODULE = "tests.tools.no_such_module:run"
MISSING_FUNCTION = "tests.tools.fault_tools:no_such_function"
# What a call to these targets answered before preloading existed (the import ran inside the call).
BROKEN = {
    MISSING_MODULE: "tool failed: ModuleNotFoundError: No module named 'tests.tools.no_such_module'",
    MISSING_FUNCTION: "tool failed: AttributeError: module 'tests.tools.fault_tools' "
    "has no attribute 'no_such_function'",
}
CALL_DEADLINE_S = 1.0
assert CALL_DEADLINE_S < IMPORT_SECONDS  # without the preload, the first call could not finish in time


@pytest.fixture(scope="module")
def preloaded_pool():
    config = PoolConfig(
        num_workers=1, max_queue=4, watch_interval_s=0.02, preload=(SLOW, ECHO, MISSING_MODULE, MISSING_FUNCTION)
    )
    with ToolPool(ToolBackendsConfig(), config) as pool:
        yield pool


def _call(pool: ToolPool, target: str, deadline_s: float = CALL_DEADLINE_S, **arguments):
    return pool.call(Job(tool=target.split(":")[1], target=target, arguments=arguments, deadline_s=deadline_s))


def test_a_slow_import_is_paid_at_start_up_not_by_the_first_call(preloaded_pool):
    result = _call(preloaded_pool, SLOW)
    assert result.status is ToolStatus.OK, result.error
    assert result.text == "imported slowly"
    assert preloaded_pool.stats.timeouts == 0


@pytest.mark.parametrize("target", sorted(BROKEN))
def test_a_target_that_cannot_be_imported_answers_with_the_same_error(preloaded_pool, target):
    pid = preloaded_pool.worker_pids[0]
    for _ in range(2):  # remembered, not retried: every call gets the same answer
        result = _call(preloaded_pool, target)
        assert result.status is ToolStatus.INFRA_ERROR and result.error == BROKEN[target]
    assert _call(preloaded_pool, ECHO, tag="after").status is ToolStatus.OK
    assert preloaded_pool.worker_pids[0] == pid  # the worker was not lost to it


def test_import_errors_are_known_at_start_up(preloaded_pool):
    assert preloaded_pool.import_errors == {t: e.removeprefix("tool failed: ") for t, e in BROKEN.items()}


def test_a_replacement_worker_preloads_too(preloaded_pool):
    pid = preloaded_pool.worker_pids[0]
    assert _call(preloaded_pool, HANG, deadline_s=0.3).status is ToolStatus.TIMEOUT  # kills the worker
    result = _call(preloaded_pool, SLOW)
    assert result.status is ToolStatus.OK, result.error
    assert preloaded_pool.worker_pids[0] != pid


def test_slow_imports_count_against_the_start_up_timeout():
    config = PoolConfig(num_workers=1, startup_timeout_s=0.5, preload=(SLOW,))
    with pytest.raises(RuntimeError, match=r"did not start within 0.5s \(importing 1 tool targets\)"):
        ToolPool(ToolBackendsConfig(), config)


def test_preload_targets_in_process():
    failed = preload_targets([ECHO, MISSING_MODULE])
    assert failed == {MISSING_MODULE: BROKEN[MISSING_MODULE].removeprefix("tool failed: ")}
    assert callable(resolve_target(ECHO))
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        resolve_target(MISSING_MODULE)
    status, _, _, error = run_job(MISSING_MODULE, {}, [], ToolBackendsConfig())
    assert status is ToolStatus.INFRA_ERROR and error == BROKEN[MISSING_MODULE]


@pytest.mark.parametrize("bad", ["no_colon", "module:", ":function", "a b:c", 3])
def test_bad_preload_targets_are_rejected(bad):
    with pytest.raises(ValueError, match="module:function"):
        PoolConfig(preload=(bad,))


def test_preload_takes_any_sequence():
    assert PoolConfig(preload=[ECHO]).preload == (ECHO,)
