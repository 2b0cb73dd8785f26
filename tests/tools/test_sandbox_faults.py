"""Faults around the sandbox: a killed worker or a passed deadline leaves no process and no scratch."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import Job, PoolConfig, ToolBackendsConfig, ToolPool
from osvl.tools.python_interpreter import python_interpreter_spec
from osvl.tools.sandbox import SandboxConfig, SandboxLimits, kill_session, run_sandboxed
from osvl.tools.sandbox import process as sandbox_process
from osvl.tools.sandbox.unsafe import SCRATCH_PREFIX, sweep_stale_scratch
from tests.tools.proctree import cmdline, descendants, still_alive, wait_for

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(60)"


def _is_sandbox_python(command: str) -> bool:
    """The sandbox's interpreter (or bwrap, which carries its command line), not some other short-lived child."""
    return {"-I", "-S", "-c"} <= set(command.split())


def scratch_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(SCRATCH_PREFIX)}


def job(spec, code: str) -> Job:
    return Job(
        "python_interpreter", spec.target, {"code": code}, deadline_s=spec.deadline_s, options=dict(spec.options)
    )


@pytest.mark.parametrize("backend", ["namespaces", "unsafe_no_boundary"])
def test_kill_9_of_a_worker_mid_sandbox_leaves_no_process_and_no_scratch(backend):
    spec = python_interpreter_spec(SandboxLimits(wall_s=60.0, cpu_s=60), SandboxConfig(backend=backend))
    before = scratch_dirs()
    with ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=1, preload=(spec.target,))) as pool:
        worker = pool.worker_pids[0]
        future = pool.submit(job(spec, SLEEPER))
        tree: dict[int, int] = {}

        def sandbox_started() -> bool:  # the snapshot is the one that showed the run: nothing can exit between
            tree.clear()
            tree.update(descendants(worker))
            return any(_is_sandbox_python(cmdline(p)) for p in tree)

        assert wait_for(sandbox_started, 20.0), "no sandbox started"
        assert backend != "unsafe_no_boundary" or scratch_dirs() - before
        os.kill(worker, signal.SIGKILL)
        result = future.result(timeout=30)
        assert result.status is ToolStatus.INFRA_ERROR and "died" in result.error
        assert wait_for(lambda: not still_alive(tree), 10.0), [cmdline(p) for p in still_alive(tree)]
        after = pool.call(job(spec, "print(6 * 7)"))  # the replacement worker serves, after its sweep
        assert after.status is ToolStatus.OK and after.text.strip() == "42", after.error
        assert after.worker and after.worker != f"pid {worker}"
    assert scratch_dirs() <= before


def _children(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return handle.read().split()
    except OSError:
        return []


def _live_processes_naming(marker: str) -> list[str]:
    """Command lines of the live (not zombie) processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and marker in (line := cmdline(int(entry))):
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if handle.read().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(f"{entry}: {line[:80]}")
            except (OSError, IndexError):
                continue
    return found


WORKER_KILLS = 16


@pytest.mark.slow  # ~40 s: a replacement worker starts after every kill
def test_workers_killed_while_their_sandbox_starts_leave_no_process_of_it():
    """SIGKILL of a worker a few milliseconds after it forked its run: bubblewrap's monitor, its PID
    namespace's init and the code may each be anywhere in their start-up, where a sandbox used to
    outlive its worker (the init blocked for good waiting on the dead monitor, or the whole run living
    on until its code ended). None of their processes may be left."""
    marker = str((512 << 20) + os.getpid())  # a memory limit no other run uses: on every sandbox command line
    limits = SandboxLimits(wall_s=300.0, cpu_s=300, memory_bytes=int(marker))
    spec = python_interpreter_spec(limits, SandboxConfig())
    sleeper = job(spec, "import time\ntime.sleep(300)")
    rng = random.Random(0)
    killed: set[int] = set()
    with ToolPool(ToolBackendsConfig(), PoolConfig(num_workers=1, preload=(spec.target,))) as pool:
        for _ in range(WORKER_KILLS):
            assert wait_for(lambda: pool.worker_pids[0] not in killed | {None}, 60.0), "no replacement worker"
            worker = pool.worker_pids[0]
            future = pool.submit(sleeper)
            forked = time.monotonic() + 30.0
            while not _children(worker):
                assert time.monotonic() < forked, "the worker started no sandbox"
                time.sleep(0.0005)
            time.sleep(rng.uniform(0.0, 0.02))
            os.kill(worker, signal.SIGKILL)
            killed.add(worker)
            result = future.result(timeout=60)
            assert result.status is ToolStatus.INFRA_ERROR and "died" in result.error, result
    assert wait_for(lambda: not _live_processes_naming(marker), 10.0), _live_processes_naming(marker)


# A session leader that puts two sleepers in process groups of their own, reports, and sleeps itself.
SESSION = """
import os, sys, time
for _ in range(2):
    if os.fork() == 0:
        os.setpgid(0, 0)
        time.sleep(60)
        os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


def _session_of_sleepers() -> tuple[subprocess.Popen, dict[int, int]]:
    leader = subprocess.Popen([sys.executable, "-c", SESSION], stdout=subprocess.PIPE, start_new_session=True)
    assert leader.stdout.readline() == b"ready\n"
    members = {leader.pid: 0, **descendants(leader.pid)}
    assert len(members) == 3, members
    return leader, members


def test_kill_session_kills_every_process_group_of_the_session():
    leader, members = _session_of_sleepers()
    try:
        assert kill_session(leader.pid) == 3
        assert wait_for(lambda: not still_alive({pid: t for pid, t in members.items() if pid != leader.pid}), 10.0)
        assert leader.wait(10) == -signal.SIGKILL
    finally:
        leader.kill()
        leader.wait()


def test_kill_session_does_not_stop_at_one_empty_scan(monkeypatch):
    """A scan can miss a live member (its parent forked it and exited while the scan read /proc: bubblewrap's
    monitor and the PID namespace's init, in CI); here the first scan is made to miss everything."""
    scans = []
    real = sandbox_process._session_members

    def missing_once(sid: int) -> list[int]:
        scans.append(sid)
        return [] if len(scans) == 1 else real(sid)

    monkeypatch.setattr(sandbox_process, "_session_members", missing_once)
    leader, members = _session_of_sleepers()
    try:
        assert kill_session(leader.pid) == 3
        assert leader.wait(10) == -signal.SIGKILL
        assert wait_for(lambda: not still_alive({pid: t for pid, t in members.items() if pid != leader.pid}), 10.0)
        assert len(scans) >= 4  # the missed scan, the one that killed, two empty ones
    finally:
        leader.kill()
        leader.wait()


def test_a_passed_deadline_kills_every_process_of_the_run():
    code = (
        "import threading, time\n"
        "for _ in range(4):\n    threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "time.sleep(60)"
    )
    config = SandboxConfig(audit_hook=False)  # threads and all; the boundary alone must clean up
    started = time.monotonic()
    run = run_sandboxed(code, SandboxLimits(wall_s=1.0), config)
    assert run.error is not None and "ran longer than 1 s" in run.error
    assert time.monotonic() - started < 10
    assert wait_for(
        lambda: (
            not descendants(os.getpid())
            or all(
                "bwrap" not in cmdline(p) and "python_interpreter" not in cmdline(p) for p in descendants(os.getpid())
            )
        ),
        5.0,
    )
    assert not [p for p in descendants(os.getpid()) if "bwrap" in cmdline(p)]


def test_stale_scratch_of_dead_workers_is_swept(tmp_path):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    stale = tmp_path / f"{SCRATCH_PREFIX}{dead}-abc"
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"
    foreign = tmp_path / f"{SCRATCH_PREFIX}site-xyz"  # not ours to judge: no pid in the name
    for folder in (stale, live, foreign):
        (folder / "work").mkdir(parents=True)
    assert sweep_stale_scratch(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and foreign.exists()
