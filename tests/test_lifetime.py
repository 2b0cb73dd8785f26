"""A process that arms the parent-death signal dies with its parent; one that does not is orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from osvl.lifetime import TORCHRUN_ENV

REPO = Path(__file__).resolve().parents[1]
CHILD = (
    "import sys, time\n"
    "from osvl.lifetime import die_with_parent\n"
    "if sys.argv[1] == 'arm':\n"
    "    die_with_parent()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)
# The parent starts the child from its main thread (as torchrun's agent does), reports its pid, then waits.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,\n"
    "                         text=True)\n"
    "child.stdout.readline()\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for its (new) parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _survives_its_parent(mode: str, wait_s: float) -> bool:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode], stdout=subprocess.PIPE, text=True, env=env)
    child = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: the parent forwards nothing
    parent.wait()
    deadline = time.monotonic() + wait_s
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    survived = alive(child)
    if survived:
        os.kill(child, signal.SIGKILL)
    return survived


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_armed_child_dies_with_its_parent_and_unarmed_one_is_orphaned():
    assert not _survives_its_parent("arm", wait_s=10)
    assert _survives_its_parent("plain", wait_s=1)  # what torchrun's ranks did before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_armed_only_under_torchrun():
    probe = (
        "import ctypes, signal\n"
        "from osvl.lifetime import die_with_torchrun_agent\n"
        "armed = die_with_torchrun_agent()\n"
        "sig = ctypes.c_int(0)\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
        "print(armed, sig.value == signal.SIGKILL)\n"
    )
    base = {k: v for k, v in os.environ.items() if k != TORCHRUN_ENV}
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    outside = subprocess.run([sys.executable, "-c", probe], env=base, capture_output=True, text=True, check=True)
    inside = subprocess.run(
        [sys.executable, "-c", probe], env={**base, TORCHRUN_ENV: "job"}, capture_output=True, text=True, check=True
    )
    assert outside.stdout.split() == ["False", "False"]  # a trainer started from a shell outlives the shell
    assert inside.stdout.split() == ["True", "True"]
