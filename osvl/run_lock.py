"""One owner per run directory: the job's global rank 0 holds ``run_dir/.owner.lock`` while it trains.

Two jobs in one run directory interleave metrics, overwrite each other's checkpoints, and a
relaunch truncates the records the other job is still writing. The lock is an exclusive
``flock`` on a file that names its holder (host, pid, job, start time). The kernel drops a flock
when its holder dies, however it dies, so a lock file whose flock is free was left by a job that
ended without releasing it (killed, crashed): a stale lock, taken over and explained.

Ranks. Only global rank 0 locks: other ranks, on this node or others, write nothing but their
checkpoint shards, and learn rank 0's outcome by broadcast, so a refused job stops on every rank
with the same message. The run directory has to be on a filesystem every node sees (checkpoint
shards from all ranks meet there); on NFS the server's lock manager carries flock across hosts.
Where locks stay node-local (some parallel filesystems), the heartbeat tells a live owner on
another host from a dead one: rank 0 refreshes the file's mtime every ``heartbeat_s``, and a lock
that names another host with a fresh heartbeat is refused even when flock succeeds.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = ".owner.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0  # a foreign host's lock whose heartbeat is older than this is stale

_held: dict[Path, RunDirLock] = {}  # run directories this process owns, by resolved path


class RunDirError(RuntimeError):
    """The job cannot own its run directory."""


class RunDirInUse(RunDirError):
    """Another live job owns the run directory."""


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    job: str
    started: float  # time.time() when it took the lock
    heartbeat: float  # the lock file's mtime when read

    def describe(self, now: float | None = None) -> str:
        age = (time.time() if now is None else now) - self.heartbeat
        return (
            f"pid {self.pid} on host {self.host} (job {self.job or '?'}, started {_when(self.started)}, "
            f"last heartbeat {max(age, 0):.0f} s ago)"
        )


def _read_owner(fd: int) -> Owner | None:
    """The holder a lock file names; None for an empty or unreadable file (a holder killed mid-write)."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        data = json.loads(raw)
        return Owner(
            str(data["host"]), int(data["pid"]), str(data.get("job", "")), float(data["started"]), os.fstat(fd).st_mtime
        )
    except (ValueError, KeyError, TypeError):
        return None


class RunDirLock:
    """``with RunDirLock(run_dir, job):`` owns ``run_dir``; ``stale`` is the dead owner it replaced."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        job: str = "",
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        if not 0 < heartbeat_s < stale_after_s:
            raise ValueError(f"need 0 < heartbeat_s < stale_after_s, got {heartbeat_s} and {stale_after_s}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.job, self.heartbeat_s, self.stale_after_s = job, heartbeat_s, stale_after_s
        self.stale: Owner | None = None
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _open_locked(self) -> int:
        """A descriptor of the current lock file with its flock held; RunDirInUse if a live job holds it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                holder = owner.describe() if owner else "a process that has not yet written its name"
                raise RunDirInUse(
                    f"job.run_dir {self.run_dir} is owned by {holder}; stop that job, wait for it "
                    "to finish, or choose another job.run_dir"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the previous owner released (and unlinked) it between our open and flock: retry

    def acquire(self) -> RunDirLock:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this lock")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        key = self.run_dir.resolve()
        if key in _held:
            raise RunDirInUse(f"job.run_dir {self.run_dir} is already owned by this process (pid {os.getpid()})")
        fd = self._open_locked()
        previous, host, now = _read_owner(fd), socket.gethostname(), time.time()
        if previous is not None and previous.host != host and now - previous.heartbeat < self.stale_after_s:
            os.close(fd)
            raise RunDirInUse(
                f"job.run_dir {self.run_dir} is owned by {previous.describe(now)}: its heartbeat is fresh, so that "
                f"job looks alive even though this filesystem let host {host} take the flock (locks that do not "
                f"reach across hosts). Stop that job, or if it is gone wait {self.stale_after_s:.0f} s after its "
                "last heartbeat"
            )
        self.stale = previous
        record = json.dumps({"host": host, "pid": os.getpid(), "job": self.job, "started": now}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        self._fd = fd
        _held[key] = self
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="osvl-run-dir-heartbeat", daemon=True)
        self._beat.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self._fd)
            except (OSError, TypeError):  # released meanwhile
                return

    @property
    def notice(self) -> str | None:
        """What taking this lock replaced, for the relaunch's report; None when the lock was free."""
        if self.stale is None:
            return None
        return (
            f"took over the stale lock of {self.stale.describe()}: it ended without releasing "
            f"{self.path.name} (killed or crashed)"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()  # while still holding the flock, so no one locks the file being removed
        except FileNotFoundError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None
        _held.pop(self.run_dir.resolve(), None)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def held_lock(run_dir: str | os.PathLike[str]) -> RunDirLock | None:
    """The lock this process holds on ``run_dir``, if any."""
    return _held.get(Path(run_dir).resolve())


@contextmanager
def own_run_dir(run_dir: str | os.PathLike[str], rank: int, job: str = "") -> Iterator[RunDirLock | None]:
    """Collective when a process group is up: rank 0 takes the lock and every rank learns the outcome,
    raising ``RunDirInUse`` (another job owns it) or ``RunDirError`` (it cannot be locked, e.g. not
    writable) with rank 0's message, so no rank waits on a peer that stopped. Yields rank 0's lock
    (None on other ranks)."""
    import torch.distributed as dist

    lock, refusal = None, None
    if rank == 0:
        try:
            lock = RunDirLock(run_dir, job).acquire()
        except RunDirInUse as error:
            refusal = ("in use", str(error))
        except OSError as error:
            refusal = ("error", f"cannot lock job.run_dir {run_dir}: {error}")
    if dist.is_initialized():
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        kind, message = refusal
        raise (RunDirInUse if kind == "in use" else RunDirError)(message)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
