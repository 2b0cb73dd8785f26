"""The sandbox_fusion backend against a loopback stand-in speaking SandboxFusion's /run_code."""

from __future__ import annotations

import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import ToolBackendsConfig
from osvl.tools.python_interpreter import python_interpreter_spec
from osvl.tools.sandbox import SandboxConfig, SandboxLimits, SandboxUnavailable, check_sandbox
from osvl.tools.worker import run_job
from tests.tools.sandbox_fusion_standin import FusionStandIn


@pytest.fixture(scope="module")
def fusion():
    standin = FusionStandIn()
    yield standin
    standin.close()


@pytest.fixture(autouse=True)
def normal_mode(fusion):
    fusion.mode = "normal"
    yield


def call(fusion, code: str, limits: SandboxLimits = SandboxLimits(wall_s=5.0), grace_s: float = 3.0):
    spec = python_interpreter_spec(
        limits, SandboxConfig("sandbox_fusion", fusion_url=fusion.url, fusion_grace_s=grace_s)
    )
    return run_job(spec.target, {"code": code}, [], ToolBackendsConfig(), spec.options)


def test_a_run_is_a_run_code_request_with_the_specs_limits(fusion):
    limits = SandboxLimits(wall_s=4.5, memory_bytes=300 << 20)
    status, text, _, error = call(fusion, "print(sum(range(10)))", limits)
    assert (status, text.strip(), error) == (ToolStatus.OK, "45", None)
    request = fusion.requests[-1]
    assert request["language"] == "python" and request["code"] == "print(sum(range(10)))"
    assert request["run_timeout"] == 4.5 and request["memory_limit_MB"] == 300
    assert request["files"] == {} and request["fetch_files"] == [] and request["stdin"] == ""


@pytest.mark.parametrize(
    "code, limits, fragment",
    [
        ("raise ValueError('bad input')", SandboxLimits(wall_s=5.0), "ValueError: bad input"),
        ("import time\ntime.sleep(10)", SandboxLimits(wall_s=1.0), "ran longer than 1 s"),
        ("print('x' * 300)", SandboxLimits(wall_s=5.0, output_chars=100), "printed more than 100"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", SandboxLimits(wall_s=5.0), "CPU time"),
    ],
)
def test_the_codes_failures_are_tool_errors(fusion, code, limits, fragment):
    status, _, _, error = call(fusion, code, limits)
    assert status is ToolStatus.TOOL_ERROR and fragment in error, error


@pytest.mark.parametrize(
    "mode, fragment",
    [
        ("sandbox_error", "could not run the code: executor pod lost"),
        ("http_500", "HTTP 500"),
        ("garbage", "not JSON"),
        ("no_status", "without a known status"),
        ("slow", "did not answer within"),
    ],
)
def test_the_services_failures_are_infra_errors(fusion, mode, fragment):
    fusion.mode = mode
    status, _, _, error = call(fusion, "print(1)", SandboxLimits(wall_s=1.0), grace_s=0.5)
    assert status is ToolStatus.INFRA_ERROR and fragment in error, error


def test_an_unreachable_service_is_an_infra_error_and_fails_the_check():
    config = SandboxConfig("sandbox_fusion", fusion_url="http://127.0.0.1:9", fusion_grace_s=0.5)
    spec = python_interpreter_spec(SandboxLimits(wall_s=1.0), config)
    status, _, _, error = run_job(spec.target, {"code": "print(1)"}, [], ToolBackendsConfig(), spec.options)
    assert status is ToolStatus.INFRA_ERROR and "unreachable" in error
    with pytest.raises(SandboxUnavailable, match="sandbox_fusion"):
        check_sandbox(config)


def test_the_check_passes_against_a_working_service(fusion):
    check_sandbox(SandboxConfig("sandbox_fusion", fusion_url=fusion.url))
    assert fusion.requests[-1]["code"] == "print(1)"
