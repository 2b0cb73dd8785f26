"""The default backend: bubblewrap puts each run in fresh user, mount, PID, network, IPC and UTS
namespaces under a seccomp filter, with the bootstrap's rlimits inside.

The sandbox's file system is built from nothing: the OS's ``/usr`` (and the interpreter's prefix
when it lives elsewhere) read-only with the prefix's own site-packages hidden, the allowed packages
read-only under ``/osvl/site``, a private procfs and a minimal ``/dev`` (read-only), and one
size-limited tmpfs at ``/tmp`` as the only writable place; ``/`` itself is read-only. No network
interface but loopback exists in the new network namespace, and seccomp refuses socket creation
anyway. bubblewrap runs without ``--new-session``: its PID namespace's init stays in the run's process
group, so the kill of a deadline reaches it at any stage of its start-up (``--die-with-parent`` arms only
once the init is set up, and an init whose monitor died before releasing it waits forever), and the
session it stays in has no controlling terminal, which is what ``--new-session`` guards against (a
sandbox pushing input into the user's terminal). The init's death takes every process of the run
with it, and the tmpfs vanishes with the mount namespace, so nothing is left on the host's disk. When
the tool worker itself dies, its pool kills its whole session (:func:`osvl.tools.sandbox.kill_session`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass

from osvl.tools.sandbox.bootstrap import bootstrap_args
from osvl.tools.sandbox.config import SandboxConfig, SandboxLimits, SandboxRun, SandboxUnavailable
from osvl.tools.sandbox.process import diagnose, run_child
from osvl.tools.sandbox.seccomp import seccomp_program

SANDBOX_PACKAGES = ("numpy",)  # third-party packages the code may import (numerics without I/O)
SITE = "/osvl/site"
SCRATCH = "/tmp"
NOBODY = "65534"
SIGNAL_BASE = 128  # bubblewrap reports a child killed by signal N as exit status 128 + N
ENVIRONMENT = {
    "PATH": "/usr/bin:/bin",
    "HOME": SCRATCH,
    "TMPDIR": SCRATCH,
    "LC_ALL": "C.UTF-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class Runtime:
    """Host paths the sandbox needs: the interpreter, its standard library, the allowed packages."""

    python: str  # real path of the interpreter binary
    stdlib: tuple[str, ...]  # the standard library and its extension modules (import roots)
    prefix: str | None  # the interpreter's prefix when outside /usr (bound read-only at the same path)
    hidden: tuple[str, ...]  # site-packages directories under a bound prefix, covered by an empty mount
    packages: tuple[str, ...]  # package directories, bound under SITE by their base name


def package_dirs(names: tuple[str, ...]) -> tuple[str, ...]:
    """Each package's directory, plus the ``NAME.libs`` folder where its wheel bundles shared libraries."""
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"sandbox package {name!r} is not installed as a package")
        package = os.path.realpath(next(iter(spec.submodule_search_locations)))
        dirs.append(package)
        bundled = os.path.join(os.path.dirname(package), f"{name}.libs")
        if os.path.isdir(bundled):
            dirs.append(os.path.realpath(bundled))
    return tuple(dirs)


def stdlib_dirs() -> tuple[str, ...]:
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    return stdlib, os.path.join(stdlib, "lib-dynload")


@functools.cache
def host_runtime() -> Runtime:
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    outside_usr = not (prefix == "/usr" or prefix.startswith("/usr/"))
    stdlib = stdlib_dirs()
    hidden = tuple(p for p in (os.path.join(stdlib[0], "site-packages"),) if outside_usr and os.path.isdir(p))
    return Runtime(python, stdlib, prefix if outside_usr else None, hidden, package_dirs(SANDBOX_PACKAGES))


def _system_dirs() -> list[str]:
    """/bin, /lib, ... as the host has them: symbolic links into /usr (merged /usr) or read-only binds."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args + ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]


def bwrap_argv(
    bwrap: str, limits: SandboxLimits, runtime: Runtime, audit_hook: bool, seccomp_fd: int, status_fd: int
) -> list[str]:
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--uid",
        NOBODY,
        "--gid",
        NOBODY,
        "--hostname",
        "osvl-sandbox",
        "--cap-drop",
        "ALL",
        "--clearenv",
    ]
    for key, value in ENVIRONMENT.items():
        args += ["--setenv", key, value]
    args += _system_dirs()
    if runtime.prefix is not None:
        args += ["--ro-bind", runtime.prefix, runtime.prefix]
    for hidden in runtime.hidden:
        args += ["--tmpfs", hidden, "--remount-ro", hidden]
    site = [f"{SITE}/{os.path.basename(p)}" for p in runtime.packages]
    for host, inside in zip(runtime.packages, site):
        args += ["--ro-bind", host, inside]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--size",
        str(limits.scratch_bytes),
        "--tmpfs",
        SCRATCH,
        "--chdir",
        SCRATCH,
        "--remount-ro",
        "/",
        "--seccomp",
        str(seccomp_fd),
        "--json-status-fd",
        str(status_fd),
        "--",
    ]
    return args + [runtime.python, *bootstrap_args(limits, audit_hook, [*runtime.stdlib, SITE], [])]


def _read_status(fd: int) -> list[dict]:
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    records = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def run_in_namespaces(code: str, limits: SandboxLimits, config: SandboxConfig) -> SandboxRun:
    bwrap = shutil.which(config.bwrap)
    if bwrap is None:
        raise SandboxUnavailable(f"bubblewrap ({config.bwrap!r}) is not installed: apt-get install bubblewrap")
    runtime = host_runtime()
    program = seccomp_program()
    seccomp_read, seccomp_write = os.pipe()
    status_read, status_write = os.pipe()
    try:
        with open(seccomp_write, "wb") as sink:  # a few hundred bytes: fits the pipe's buffer
            sink.write(program)
        argv = bwrap_argv(bwrap, limits, runtime, config.audit_hook, seccomp_read, status_write)
        outcome = run_child(
            argv, code, limits, env={"PATH": ENVIRONMENT["PATH"]}, cwd="/", pass_fds=(seccomp_read, status_write)
        )
    finally:
        os.close(seccomp_read)
        os.close(status_write)
    try:
        status = _read_status(status_read)
    finally:
        os.close(status_read)
    if not any("child-pid" in record for record in status) and not outcome.timed_out:
        raise SandboxUnavailable(
            f"bubblewrap could not create the sandbox (exit status {outcome.exit_code}): "
            f"{outcome.stderr.strip()[-500:] or 'no message'}"
        )
    return SandboxRun(
        outcome.stdout,
        outcome.stderr,
        outcome.exit_code,
        diagnose(outcome, limits, signal_base=SIGNAL_BASE),
        backend="namespaces",
    )
