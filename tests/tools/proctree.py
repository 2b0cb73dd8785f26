"""The host's process tree from /proc, for tests that check nothing outlives a run."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of every live process below ``root``."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
            started[int(entry)] = stat[1]
    found, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found[child] = started[child]
            stack.append(child)
    return found


def still_alive(processes: dict[int, int]) -> list[int]:
    """The processes of a snapshot that still run (same pid and start time: not a reused pid)."""
    return [pid for pid, start in processes.items() if (stat := _stat(pid)) is not None and stat[1] == start]


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""
