"""Process lifetime: a rank dies with the ``torchrun`` agent that started it.

``torchrun`` starts every rank in a session of its own, so a signal to the agent's process group
never reaches the ranks, and an agent killed with SIGKILL forwards nothing: its ranks ran on as
orphans, kept writing checkpoints into the run directory, and raced the relaunch. Linux's
parent-death signal (``prctl(PR_SET_PDEATHSIG)``) has the kernel signal the child when its parent
exits, however it exits.

This module imports nothing heavy, so ``osvl.train`` arms the signal before the seconds of torch
imports during which the agent could die unnoticed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # set by torch elastic agents (torchrun) in every worker's environment


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Has the kernel send ``sig`` to this process when its parent exits; False off Linux (not armed).

    The signal follows the parent *thread* that forked this process, so arm it only in a child
    started by its parent's main thread (torchrun's agent starts ranks from its main thread).
    A parent that died before the call has already handed this process to init: it exits at once.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if parent == 1 or os.getppid() != parent:  # orphaned before the signal was armed
        os.kill(os.getpid(), sig)
    return True


def die_with_torchrun_agent() -> bool:
    """``die_with_parent`` in a rank that ``torchrun`` started; nothing elsewhere (a trainer run from
    a shell must survive the shell, e.g. under ``nohup``). Returns whether it was armed."""
    return TORCHRUN_ENV in os.environ and die_with_parent()
