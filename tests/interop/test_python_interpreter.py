import json
import os

import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import ToolBackendsConfig
from osvl.tools.python_interpreter import python_interpreter_spec
from osvl.tools.sandbox import SandboxConfig, SandboxLimits, SandboxUnavailable, check_sandbox, run_sandboxed
from osvl.tools.worker import run_job

LOCAL_BACKENDS = ["namespaces", "unsafe_no_boundary"]


def run_tool(code: str, limits: SandboxLimits = SandboxLimits(), sandbox: SandboxConfig = SandboxConfig()):
    spec = python_interpreter_spec(limits, sandbox)
    return run_job(spec.target, {"code": code}, [], ToolBackendsConfig(), spec.options)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_prints_come_back_ok(backend):
    status, text, images, error = run_tool("import math\nprint(math.factorial(10))", sandbox=SandboxConfig(backend))
    assert (status, text.strip(), images, error) == (ToolStatus.OK, "3628800", [], None)


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_numpy_computation_returns_the_right_output(backend):
    code = (
        "import json\nimport numpy as np\nA = np.array([[4.0, 1.0], [2.0, 3.0]])\n"
        "print(json.dumps({'x': np.linalg.solve(A, np.array([1.0, 2.0])).tolist(), "
        "'prod': int(np.arange(1, 11).prod())}))"
    )
    status, text, _, error = run_tool(code, sandbox=SandboxConfig(backend))
    assert status is ToolStatus.OK and error is None, error
    out = json.loads(text)
    assert out["x"] == pytest.approx([0.1, 0.6], abs=1e-12)  # 4x + y = 1, 2x + 3y = 2
    assert out["prod"] == 3628800


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
@pytest.mark.parametrize(
    "limits, code, fragment",
    [
        (SandboxLimits(wall_s=2.0), "import time\ntime.sleep(4)\nprint('late')", "ran longer than 2 s"),
        (SandboxLimits(cpu_s=1, wall_s=30.0), "while True:\n    pass", "more than 1 s of CPU time"),
        (SandboxLimits(memory_bytes=160 << 20), "x = bytearray(200 << 20)", "out of memory (limit 160 MiB)"),
        (SandboxLimits(file_bytes=1 << 20), "open('big', 'wb').write(b'0' * (2 << 20))", "File too large"),
        (SandboxLimits(output_chars=100), "print('x' * 500)", "printed more than 100 characters"),
        (SandboxLimits(open_files=20), "fs = [open('f%d' % i, 'w') for i in range(40)]", "Too many open files"),
        (SandboxLimits(max_code_chars=10), "print('this is longer than ten')", "limit is 10"),
    ],
)
def test_the_specs_limits_are_the_ones_that_run(backend, limits, code, fragment):
    """python_interpreter_spec(SandboxLimits(...)) reaches the sandbox in the worker (it used to change
    only the deadline: a 2 s wall clock still let a 4 s sleep return ok)."""
    status, text, _, error = run_tool(code, limits, SandboxConfig(backend))
    assert status is ToolStatus.TOOL_ERROR and fragment in error, (status, text, error)


def test_the_scratch_tmpfs_is_size_limited():
    limits = SandboxLimits(scratch_bytes=1 << 20, file_bytes=8 << 20)
    status, _, _, error = run_tool("open('big', 'wb').write(b'0' * (3 << 20))", limits)
    assert status is ToolStatus.TOOL_ERROR and "No space left on device" in error


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_files_inside_the_scratch_directory_work_and_vanish(backend):
    run = run_sandboxed(
        "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd())",
        SandboxLimits(wall_s=5.0),
        SandboxConfig(backend),
    )
    assert run.error is None and run.stdout.startswith("hi "), run
    scratch = run.stdout.split()[1]
    assert scratch == "/tmp" if backend == "namespaces" else not os.path.exists(scratch)


def test_the_rest_of_site_packages_stays_out_of_reach():
    run = run_sandboxed("import torch", SandboxLimits(wall_s=10.0), SandboxConfig(audit_hook=False))
    assert run.error is not None and "No module named 'torch'" in run.error


def test_tool_entry_turns_failures_into_tool_error():
    status, text, _, error = run_tool("import socket\nsocket.socket()")
    assert status is ToolStatus.TOOL_ERROR and "socket" in error and text == ""
    status, _, _, error = run_tool("1 / 0")
    assert status is ToolStatus.TOOL_ERROR and "ZeroDivisionError" in error


def test_without_its_boundary_the_interpreter_refuses_and_says_how_to_opt_in():
    missing = SandboxConfig(bwrap="/nonexistent/bwrap")
    status, _, _, error = run_tool("print(1)", sandbox=missing)
    assert status is ToolStatus.INFRA_ERROR
    assert "refuses to run" in error and "apt-get install bubblewrap" in error
    assert "tools.python_sandbox = 'unsafe_no_boundary'" in error
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        check_sandbox(missing)
    check_sandbox(SandboxConfig())  # the default boundary works on this machine (make install sets it up)


def test_limits_and_config_are_validated():
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=float("nan"))
    with pytest.raises(ValueError, match="scratch_bytes"):
        SandboxLimits(scratch_bytes=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        SandboxConfig(backend="none")
    with pytest.raises(ValueError, match="needs an http"):
        SandboxConfig(backend="sandbox_fusion")
    with pytest.raises(ValueError, match="code must be a str"):
        run_sandboxed(b"print(1)")  # type: ignore[arg-type]


def test_spec_carries_its_limits_and_its_deadline_outlasts_the_wall_clock():
    limits = SandboxLimits(cpu_s=1, wall_s=2.0)
    spec = python_interpreter_spec(limits, SandboxConfig(audit_hook=False))
    assert spec.deadline_s > limits.wall_s and spec.parameters["required"] == ["code"]
    assert spec.options == {"limits": limits, "sandbox": SandboxConfig(audit_hook=False)}
    assert spec.parameters["properties"]["code"]["maxLength"] == limits.max_code_chars
    assert "isolated sandbox" in spec.description
    assert "isolated" not in python_interpreter_spec(sandbox=SandboxConfig("unsafe_no_boundary")).description
