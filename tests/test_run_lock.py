"""One owner per run directory: a live owner (another process, another host) refuses a second job,
a dead owner's lock is taken over and explained, and the holder's heartbeat keeps the file fresh."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from osvl.run_lock import LOCK_FILE, RunDirError, RunDirInUse, RunDirLock, held_lock, own_run_dir
from tests.parallel.harness import run_ranks

REPO = Path(__file__).resolve().parents[1]
HOLDER = (
    "import sys, time\n"
    "from osvl.run_lock import RunDirLock\n"
    "RunDirLock(sys.argv[1], 'holder-job').acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


def _holder(run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline().strip() == "held"
    return process


def test_lock_names_its_owner_and_is_removed_on_release(tmp_path):
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir, "job-a") as lock:
        owner = json.loads((run_dir / LOCK_FILE).read_text())
        assert (owner["host"], owner["pid"], owner["job"]) == (socket.gethostname(), os.getpid(), "job-a")
        assert held_lock(run_dir) is lock and lock.notice is None
        with pytest.raises(RunDirInUse, match="already owned by this process"):
            RunDirLock(run_dir).acquire()
    assert not (run_dir / LOCK_FILE).exists() and held_lock(run_dir) is None


def test_live_owner_refuses_and_dead_owner_is_taken_over_with_an_explanation(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(
            RunDirInUse,
            match=rf"owned by pid {holder.pid} on host {socket.gethostname()} "
            r"\(job holder-job, started .*\); stop that job",
        ):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()  # SIGKILL: no release, the file stays behind
        holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    with RunDirLock(tmp_path, "relaunch") as lock:
        assert lock.stale is not None and lock.stale.pid == holder.pid
        assert lock.notice.startswith(f"took over the stale lock of pid {holder.pid} on host")
        assert "killed or crashed" in lock.notice
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def _foreign_lock(run_dir: Path, heartbeat_age_s: float) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps({"host": "node-7", "pid": 4242, "job": "other", "started": time.time() - 500}))
    stamp = time.time() - heartbeat_age_s
    os.utime(path, (stamp, stamp))


def test_another_hosts_fresh_heartbeat_refuses_where_flock_does_not_reach(tmp_path):
    """The file's flock is free here (the owner runs on node-7), as on filesystems whose locks are node-local."""
    _foreign_lock(tmp_path, heartbeat_age_s=5)
    with pytest.raises(RunDirInUse, match=r"pid 4242 on host node-7 .*heartbeat is fresh"):
        RunDirLock(tmp_path, stale_after_s=120).acquire()
    _foreign_lock(tmp_path, heartbeat_age_s=600)
    with RunDirLock(tmp_path, stale_after_s=120) as lock:
        assert "stale lock of pid 4242 on host node-7" in lock.notice and "last heartbeat 600 s ago" in lock.notice


def test_holder_refreshes_its_heartbeat(tmp_path):
    with RunDirLock(tmp_path, heartbeat_s=0.05, stale_after_s=1.0):
        first = (tmp_path / LOCK_FILE).stat().st_mtime_ns
        deadline = time.monotonic() + 5
        while (tmp_path / LOCK_FILE).stat().st_mtime_ns == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (tmp_path / LOCK_FILE).stat().st_mtime_ns > first


def test_unreadable_lock_file_left_by_a_kill_mid_write_is_taken(tmp_path):
    (tmp_path / LOCK_FILE).write_text('{"host": "vm", "pi')
    with RunDirLock(tmp_path) as lock:
        assert lock.stale is None and json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_bad_heartbeat_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="heartbeat_s < stale_after_s"):
        RunDirLock(tmp_path, heartbeat_s=10, stale_after_s=5)


def test_own_run_dir_without_a_process_group(tmp_path):
    with own_run_dir(tmp_path, rank=0, job="j") as lock:
        assert lock is not None and held_lock(tmp_path) is lock
    with own_run_dir(tmp_path, rank=1) as lock:  # other ranks never touch the file
        assert lock is None and not (tmp_path / LOCK_FILE).exists()
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid}"), own_run_dir(tmp_path, rank=0):
            pass
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="cannot lock job.run_dir .*file"), own_run_dir(tmp_path / "file", rank=0):
        pass  # a path that is not a directory


def _refused_on_every_rank(rank: int, world: int, run_dir: str, holder_pid: int) -> None:
    try:
        with own_run_dir(run_dir, rank):
            pass
    except RunDirInUse as error:
        assert f"is owned by pid {holder_pid} on host" in str(error), (rank, str(error))
    else:
        raise AssertionError(f"rank {rank} of {world} went on in a run directory another job owns")


def test_every_rank_learns_rank_0s_refusal(tmp_path):
    """Only rank 0 reads the lock; rank 1 (here, or on another node) stops with the same message."""
    holder = _holder(tmp_path)
    try:
        run_ranks(_refused_on_every_rank, 2, str(tmp_path), holder.pid)
    finally:
        holder.kill()
        holder.wait()
