import pytest

from bench.rollout.engine_process import await_ready, spawn, start_context
from osvl.rollout.engine import EngineError
from tests.bench.rollout import hello_children


@pytest.fixture(scope="module")
def context():
    return start_context("spawn")


def _start(context, target, argument):
    process, conn = spawn(context, target, argument, "osvl-test-child")
    assert process.name == "osvl-test-child" and process.daemon
    return process, conn


def test_ready_child_hands_its_payload_back(context):
    process, conn = _start(context, hello_children.ready, {"version": 3})
    try:
        assert await_ready(process, conn, 60.0, "test child", RuntimeError) == {"version": 3}
    finally:
        conn.close()
        process.join(10)
    assert process.exitcode is not None


@pytest.mark.parametrize(
    "target, argument, error, message",
    [
        (hello_children.report_failure, "no model here", EngineError, "test child failed to start: no model here"),
        (
            hello_children.die,
            3,
            RuntimeError,
            r"test child failed to start: died while starting \(exit code (3|None)\)",
        ),
        (hello_children.stay_silent, 30.0, EngineError, r"test child did not start within 0.5s"),
    ],
)
def test_child_that_never_says_ready_is_the_callers_error(context, target, argument, error, message):
    process, conn = _start(context, target, argument)
    try:
        with pytest.raises(error, match=message):
            await_ready(process, conn, 0.5 if target is hello_children.stay_silent else 60.0, "test child", error)
    finally:
        process.kill()
        process.join(10)
        conn.close()
