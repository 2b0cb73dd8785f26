"""``unsafe_no_boundary``: a plain child process, fenced only by the audit hook and rlimits.

Not a security boundary (the hook is Python-level and Python code can reach around it); it exists
for machines without user namespaces or a SandboxFusion service, where a recipe must opt in by
name, and as the baseline the benchmark compares the namespaces backend against.

Its scratch directory lives on the host as ``osvl-py-<worker pid>-*``: removed after each run, and
by :func:`sweep_stale_scratch` (run at pool start) when a killed worker could not remove it. The
child gets SIGKILL when the thread that started it dies (``PR_SET_PDEATHSIG``), so a killed worker
leaves no runaway child behind.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import sys
import tempfile

from osvl.tools.sandbox.bootstrap import bootstrap_args
from osvl.tools.sandbox.config import SandboxLimits, SandboxRun
from osvl.tools.sandbox.namespaces import ENVIRONMENT, SANDBOX_PACKAGES, package_dirs, stdlib_dirs
from osvl.tools.sandbox.process import diagnose, run_child

SCRATCH_PREFIX = "osvl-py-"
_SCRATCH_NAME = re.compile(rf"{SCRATCH_PREFIX}(\d+)-")
PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: between fork and exec only the call runs


def _die_with_parent(parent: int) -> None:
    """In the child before exec: SIGKILL when the parent dies; and if it already has, die now."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_scratch(folder: str | None = None) -> list[str]:
    """Remove scratch directories whose worker is gone; returns what was removed."""
    folder = folder or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _SCRATCH_NAME.match(name)
        if match and int(match[1]) != os.getpid() and not _alive(int(match[1])):
            path = os.path.join(folder, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def run_unsafe(code: str, limits: SandboxLimits, audit_hook: bool = True) -> SandboxRun:
    packages = package_dirs(SANDBOX_PACKAGES)
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as scratch:
        workdir, site = os.path.join(scratch, "work"), os.path.join(scratch, "site")
        os.mkdir(workdir)
        os.mkdir(site)
        for target in packages:  # only the allowed packages import; the rest of site-packages stays out
            os.symlink(target, os.path.join(site, os.path.basename(target)))
        env = {**ENVIRONMENT, "HOME": workdir, "TMPDIR": workdir}
        parent = os.getpid()
        argv = [sys.executable, *bootstrap_args(limits, audit_hook, [*stdlib_dirs(), site], list(packages))]
        outcome = run_child(argv, code, limits, env=env, cwd=workdir, preexec_fn=lambda: _die_with_parent(parent))
    return SandboxRun(
        outcome.stdout, outcome.stderr, outcome.exit_code, diagnose(outcome, limits), backend="unsafe_no_boundary"
    )
