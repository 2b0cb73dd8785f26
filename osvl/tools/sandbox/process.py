"""Running one sandbox child: code on stdin, capped output, a wall-clock deadline, and a kill that
takes everything the run started with it.

Every run is a process group of its own in a session without a terminal. A tool worker owns such a
session (:func:`own_sandbox_session`) and its runs stay in it, so its pool can kill every process of
them by the session id (:func:`kill_session`) even after the worker itself was killed, whatever
stage of its start-up a run had reached; anywhere else each run opens a session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from osvl.tools.sandbox.bootstrap import VIOLATION_EXIT
from osvl.tools.sandbox.config import SandboxLimits

_owns_session = False  # set in a tool worker: its runs join its session, where its pool finds them


def own_sandbox_session() -> None:
    """Make this process (a tool worker, before it starts any run) the leader of a new session without a
    controlling terminal; the sandbox runs it starts from then on stay in that session, whose id is its pid."""
    global _owns_session
    os.setsid()
    _owns_session = True


def _session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and fields[0] not in ("Z", "X") and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def kill_session(sid: int, timeout_s: float = 5.0) -> int:
    """SIGKILL every process of session ``sid`` until two scans in a row find none (or ``timeout_s`` passed);
    returns how many were signalled. The session's leader must not be reaped yet, so that ``sid`` cannot
    name a newer session. Signals from the host reach a PID namespace's init too, and its death takes its
    namespace along.

    One empty scan proves nothing: a process listed when the scan read /proc can fork and exit before its
    own entry is read, and its child is in neither (seen under load: bubblewrap's monitor cloned the PID
    namespace's init and exited within one scan, and the init lived on). A child forked before its parent
    was read is listed by the next scan."""
    signalled: set[int] = set()
    deadline = time.monotonic() + timeout_s
    empty_scans = 0
    while empty_scans < 2 and time.monotonic() < deadline:
        members = _session_members(sid)
        empty_scans = 0 if members else empty_scans + 1
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            signalled.add(pid)
        time.sleep(0.01)
    return len(signalled)


@dataclass
class ChildOutcome:
    stdout: str
    stderr: str
    exit_code: int | None  # as the child reported it; a signal is -N (plain child) or 128+N (bubblewrap)
    timed_out: bool
    overflow: bool


def _drain(stream, cap: int, sink: list[bytes], overflow: threading.Event, on_overflow: Callable[[], None]) -> None:
    total = 0
    while chunk := stream.read1(65536):
        if total < cap:
            sink.append(chunk[: cap - total])
        total += len(chunk)
        if total > cap and not overflow.is_set():
            overflow.set()
            on_overflow()


def run_child(
    argv: Sequence[str],
    code: str,
    limits: SandboxLimits,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    preexec_fn: Callable[[], None] | None = None,
) -> ChildOutcome:
    """Run ``argv`` with ``code`` on stdin until it exits, prints too much, or ``limits.wall_s`` passes.

    The child leads a new process group (in the worker's session, else in a new session); a deadline or an
    overflow kills the whole group with SIGKILL (for bubblewrap: its monitor and the PID namespace's init,
    whose death takes the namespace along)."""
    child = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=not _owns_session,
        process_group=0 if _owns_session else None,
        close_fds=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=preexec_fn,
    )  # noqa: PLW1509 - the worker's calling thread is its only one

    def kill() -> None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    out: list[bytes] = []
    err: list[bytes] = []
    overflow = threading.Event()
    cap = limits.output_chars  # characters ~ bytes for the cap
    readers = [
        threading.Thread(target=_drain, args=(child.stdout, cap, out, overflow, kill), daemon=True),
        threading.Thread(target=_drain, args=(child.stderr, cap, err, overflow, kill), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        child.stdin.write(code.encode("utf-8", "surrogatepass"))
        child.stdin.close()
    except BrokenPipeError:
        pass
    # End of output is end of the run (Popen.wait with a timeout polls with growing sleeps, which
    # added up to ~30 ms to every call); a child that closed its output but runs on is waited for.
    deadline = time.monotonic() + limits.wall_s
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    timed_out = False
    try:
        child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    kill()  # nothing of the run may outlive it
    child.wait()
    for reader in readers:
        reader.join(timeout=5.0)
    return ChildOutcome(
        b"".join(out).decode("utf-8", "replace"),
        b"".join(err).decode("utf-8", "replace"),
        child.returncode,
        timed_out,
        overflow.is_set(),
    )


def diagnose(outcome: ChildOutcome, limits: SandboxLimits, signal_base: int | None = None) -> str | None:
    """The message the model reads for a run that did not end cleanly; None for a clean exit.

    ``signal_base``: 128 when the exit status of a killed child arrives as 128+N (bubblewrap)."""
    code, stderr = outcome.exit_code, outcome.stderr
    if outcome.overflow:
        return f"the code printed more than {limits.output_chars} characters; print less"
    if outcome.timed_out:
        return f"the code ran longer than {limits.wall_s:g} s and was stopped"
    if code == 0:
        return None
    if code == VIOLATION_EXIT:
        reason = stderr.rsplit("sandbox violation:", 1)[-1].strip()
        return f"sandbox refused the code: {reason}"
    killed_by = -code if code is not None and code < 0 else None
    if signal_base is not None and code is not None and signal_base < code < signal_base + 65:
        killed_by = code - signal_base
    if killed_by in (signal.SIGXCPU, signal.SIGKILL):
        return f"the code used more than {limits.cpu_s} s of CPU time and was stopped"
    if killed_by == signal.SIGXFSZ:
        return f"the code wrote a file larger than {limits.file_bytes} bytes"
    if killed_by == signal.SIGSYS:
        return "the code made a system call the sandbox forbids and was stopped"
    if killed_by is not None:
        try:
            name = signal.Signals(killed_by).name
        except ValueError:
            name = str(killed_by)
        return f"the code was killed by signal {name}"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {code}"
    if "MemoryError" in last:
        return f"the code ran out of memory (limit {limits.memory_bytes >> 20} MiB)"
    return f"the code failed: {last}\n{stderr.strip()[-2000:]}"
