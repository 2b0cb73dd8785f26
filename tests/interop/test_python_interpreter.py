import json
import os
from pathlib import Path

import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import ToolsConfig
from osvl.tools.python_interpreter import (
    SandboxLimits,
    python_interpreter_spec,
    run_sandboxed,
)
from osvl.tools.worker import run_job

FAST = SandboxLimits(cpu_s=1, wall_s=2.0, output_chars=2_000, file_bytes=1 << 20, memory_bytes=256 << 20)
OUTSIDE = Path("/tmp/osvl_sandbox_escape_probe")


def run_tool(code: str):
    return run_job(python_interpreter_spec().target, {"code": code}, [], ToolsConfig())


def test_prints_come_back_ok():
    status, text, images, error = run_tool("import math\nprint(math.factorial(10))")
    assert (status, text.strip(), images, error) == (ToolStatus.OK, "3628800", [], None)


def test_numpy_computation_returns_the_right_output():
    code = ("import json\nimport numpy as np\nA = np.array([[4.0, 1.0], [2.0, 3.0]])\n"
            "print(json.dumps({'x': np.linalg.solve(A, np.array([1.0, 2.0])).tolist(), "
            "'prod': int(np.arange(1, 11).prod())}))")
    status, text, _, error = run_tool(code)
    assert status is ToolStatus.OK and error is None, error
    out = json.loads(text)
    assert out["x"] == pytest.approx([0.1, 0.6], abs=1e-12)  # 4x + y = 1, 2x + 3y = 2
    assert out["prod"] == 3628800


@pytest.mark.parametrize("code, fragment", [
    (f"import numpy as np\nnp.save('{OUTSIDE}', np.zeros(3))", "outside the working directory"),
    ("import numpy as np\nprint(np.fromfile('/etc/hostname', dtype=np.uint8))", "reading '/etc/hostname'"),
    ("import numpy.ctypeslib\nimport ctypes", "ctypes is not allowed"),
    ("import torch", "No module named 'torch'"),  # the rest of site-packages stays out of reach
])
def test_numpy_does_not_widen_the_sandbox(code, fragment):
    run = run_sandboxed(code, SandboxLimits(cpu_s=2, wall_s=5.0))
    assert run.error is not None and fragment in run.error, run
    assert not OUTSIDE.exists() and not Path(f"{OUTSIDE}.npy").exists()


def test_files_inside_the_scratch_directory_work_and_vanish():
    run = run_sandboxed("import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd())", FAST)
    assert run.error is None and run.stdout.startswith("hi ")
    assert not Path(run.stdout.split()[1]).exists()


@pytest.mark.parametrize("code, fragment", [
    (f"open('{OUTSIDE}', 'w').write('x')", "outside the working directory"),
    (f"try:\n    open('{OUTSIDE}', 'w')\nexcept BaseException:\n    pass\nprint('escaped')", "outside"),
    ("open('../escape.txt', 'w')", "outside the working directory"),
    ("import os\nos.symlink('/tmp', 'link')\nopen('link/x', 'w')", "os.symlink outside"),
    ("print(open('/etc/hostname').read())", "reading '/etc/hostname'"),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "socket"),
    ("import os\nwhile True:\n    os.fork()", "os.fork"),
    ("import subprocess\nsubprocess.run(['true'])", "not allowed"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.kill(os.getppid(), 9)", "os.kill"),
    ("import ctypes", "ctypes"),
    ("import os\nos.path.realpath.__code__ = (lambda p, strict=False: p).__code__", "__code__"),
    ("while True:\n    print('x' * 100)", "printed more than"),
    ("import time\ntime.sleep(30)", "ran longer than"),
    ("x = bytearray(1 << 30)", "out of memory"),
    ("open('big', 'wb').write(b'0' * (4 << 20))", "File too large"),
    ("1 / 0", "ZeroDivisionError"),
])
def test_escape_attempts_and_runaways_are_tool_errors(code, fragment):
    run = run_sandboxed(code, FAST)
    assert run.error is not None and fragment in run.error, run
    assert not OUTSIDE.exists() and not Path("/tmp/x").exists()


def test_busy_loop_is_stopped_by_the_cpu_limit():
    run = run_sandboxed("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=60.0))
    assert run.error is not None and "CPU time" in run.error, run


def test_tool_entry_turns_failures_into_tool_error():
    status, text, _, error = run_tool("import socket\nsocket.socket()")
    assert status is ToolStatus.TOOL_ERROR and "sandbox refused" in error and text == ""


def test_limits_and_code_are_validated():
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=float("nan"))
    with pytest.raises(ValueError, match="code must be a str"):
        run_sandboxed(b"print(1)")  # type: ignore[arg-type]
    assert "limit is 10" in run_sandboxed("x" * 11, SandboxLimits(max_code_chars=10)).error


def test_spec_deadline_outlasts_the_sandbox_wall_clock():
    spec = python_interpreter_spec(FAST)
    assert spec.deadline_s > FAST.wall_s and spec.parameters["required"] == ["code"]
    assert os.path.basename(spec.target.split(":")[0].replace(".", "/")) == "python_interpreter"
