"""``python_interpreter``: run model-written Python in a throwaway, network-less child process.

Off by default (a profile registers it only when asked). Two layers keep the code in its box:

* the OS: a fresh interpreter (``-I -S``) in a new session with RLIMITs on CPU time, address
  space, file size and process count, a temporary working directory that is deleted afterwards,
  an empty environment, a wall-clock deadline and a cap on the output read back;
* an audit hook installed before the code runs (PEP 578) that ends the process on any socket,
  process creation, signal, rlimit change, interpreter introspection (frames, gc, ctypes), or file
  access outside the working directory (reads are also allowed in the standard library and in the
  allow-listed packages, :data:`SANDBOX_PACKAGES`).

Importing a refused module (``ctypes`` ...) raises ``ImportError`` instead of ending the process:
numpy imports ctypes optionally and works without it, while code that needs ctypes still fails.
Allowed packages reach the child through a directory of symbolic links, so the rest of
site-packages is neither importable nor readable.

A violation exits with a reserved status; every failure, the policy's code or its escape
attempts, ends as ``tool_error`` with a message the model can read. This is a guard against
runaway and careless code, not a boundary against a determined kernel exploit (that needs
namespaces or seccomp, which need privileges the tool worker may not have).
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from osvl.tools.config import ToolsConfig
from osvl.tools.errors import ToolError
from osvl.tools.registry import ToolOutput, ToolSpec

VIOLATION_EXIT = 97  # the audit hook's exit status; nothing else in the child uses it

# Runs in the child before the model's code; receives the code on stdin, then as arguments the
# limits, the import path and (after "--") further readable roots. Everything lives in one function so the model's globals cannot reach the hook.
_BOOTSTRAP = r'''
def _install():
    import posix, resource, sys
    cpu_s, memory, file_bytes = (int(v) for v in sys.argv[1:4])
    split = sys.argv.index("--")
    roots, extra_roots = sys.argv[4:split], sys.argv[split + 1:]
    for kind, value in ((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)), (resource.RLIMIT_AS, (memory, memory)),
                        (resource.RLIMIT_FSIZE, (file_bytes, file_bytes)), (resource.RLIMIT_NPROC, (0, 0)),
                        (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(kind, value)  # NPROC does not bind root; the hook below refuses forks anyway
    code = sys.stdin.read()
    getcwd, lstat, readlink, leave, write = posix.getcwd, posix.lstat, posix.readlink, posix._exit, posix.write
    join, decode = str.join, bytes.decode

    def resolve(path):
        # realpath from C functions only: nothing the model's code can monkeypatch
        if path[:1] != "/":
            path = getcwd() + "/" + path
        parts = [p for p in path.split("/") if p and p != "."]
        out, hops = [], 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if out:
                    out.pop()
                continue
            candidate = "/" + "/".join(out + [part])
            try:
                mode = lstat(candidate).st_mode
            except OSError:
                out.append(part)
                continue
            if mode & 0o170000 == 0o120000:
                hops += 1
                if hops > 40:
                    stop("too many symbolic links in " + path)
                target = readlink(candidate)
                if target[:1] == "/":
                    out = []
                parts = [p for p in target.split("/") if p and p != "."] + parts
            else:
                out.append(part)
        return "/" + "/".join(out)

    root = resolve(getcwd())
    readable = tuple(resolve(p) for p in roots + extra_roots) + (root,)
    sys.path[:] = list(roots)
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_APPEND | posix.O_TRUNC
    refused = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
               "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit",
               "resource.prlimit", "os.chdir", "os.chroot", "gc.get_objects", "gc.get_referrers",
               "gc.get_referents", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof",
               "ctypes.call_function", "os.setuid", "os.setgid"}
    blocked_modules = {"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi",
                       "_testinternalcapi", "faulthandler"}
    mutating = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                "os.chown", "os.truncate", "os.utime", "os.mkfifo", "os.mknod", "shutil.rmtree",
                "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move"}
    listing = {"os.listdir", "os.scandir", "glob.glob", "os.walk"}
    function_internals = {"__code__", "__globals__", "__closure__"}

    def stop(reason):
        write(2, ("\nsandbox violation: " + reason + "\n").encode("utf-8", "replace"))
        leave(97)

    def text(path):
        # only immutable values: a PathLike could answer differently when the real call asks again
        if isinstance(path, str):
            return join("", [path])
        if isinstance(path, bytes):
            return decode(path, "utf-8", "surrogateescape")
        stop("file names must be str or bytes, got " + type(path).__name__)

    def inside(path, roots):
        real = resolve(text(path))
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event, args):
        if event.startswith("socket.") or event in refused:
            stop(event + " is not allowed")
        if event == "import" and args[0].split(".")[0] in blocked_modules:
            raise ImportError("importing " + args[0] + " is not allowed in the sandbox")
        if event == "object.__setattr__" and args[1] in function_internals:
            stop("replacing " + args[1] + " is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return  # an already open descriptor
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writes and not inside(path, (root,)):
                stop("writing " + repr(path) + " outside the working directory is not allowed")
            if not writes and not inside(path, readable):
                stop("reading " + repr(path) + " is not allowed")
        elif event in mutating:
            for path in args[:2]:
                if isinstance(path, (str, bytes)) and not inside(path, (root,)):
                    stop(event + " outside the working directory is not allowed")
        elif event in listing and args and isinstance(args[0], (str, bytes)) and not inside(args[0], readable):
            stop("listing " + repr(args[0]) + " is not allowed")

    sys.addaudithook(hook)
    return compile(code, "<python_interpreter>", "exec")

exec(_install(), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # RLIMIT_CPU of the child
    wall_s: float = 10.0  # killed after this, e.g. a sleeping loop
    memory_bytes: int = 512 << 20  # RLIMIT_AS; the bare interpreter needs ~30 MB
    file_bytes: int = 8 << 20  # RLIMIT_FSIZE: the largest file the code may write
    output_chars: int = 8_000  # stdout + stderr read back; more is an error, not a truncation
    max_code_chars: int = 20_000

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_bytes", "file_bytes", "output_chars", "max_code_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer, got {value!r}")
        if not (math.isfinite(self.wall_s) and self.wall_s > 0):
            raise ValueError(f"SandboxLimits.wall_s must be a positive number, got {self.wall_s!r}")


@dataclass
class SandboxRun:
    """What one run produced; ``error`` is None only for a clean exit within every limit."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None


SANDBOX_PACKAGES = ("numpy",)  # third-party packages the code may import (numerics without I/O)


def _stdlib_roots() -> list[str]:
    stdlib = os.path.dirname(os.__file__)
    return [stdlib, os.path.join(stdlib, "lib-dynload")]


def _package_dirs(names: tuple[str, ...]) -> list[str]:
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
    return dirs


def _link_packages(site: str, package_dirs: list[str]) -> None:
    """A private site directory: links to the allowed packages only, so nothing else imports."""
    for target in package_dirs:
        os.symlink(target, os.path.join(site, os.path.basename(target)))


def _drain(stream, cap: int, sink: list[bytes], overflow: threading.Event, on_overflow) -> None:
    total = 0
    while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
        if total < cap:
            sink.append(chunk[: cap - total])
        total += len(chunk)
        if total > cap and not overflow.is_set():
            overflow.set()
            on_overflow()


def run_sandboxed(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxRun:
    """Run ``code`` in a fresh child under ``limits``; never raises for anything the code does."""
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")  # noqa: TRY004 (bad input is a ValueError throughout osvl)
    if len(code) > limits.max_code_chars:
        return SandboxRun("", "", None, f"the code is {len(code)} characters; the limit is {limits.max_code_chars}")
    packages = _package_dirs(SANDBOX_PACKAGES)
    with tempfile.TemporaryDirectory(prefix="osvl-py-") as workdir, \
            tempfile.TemporaryDirectory(prefix="osvl-py-site-") as site:
        _link_packages(site, packages)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LC_ALL": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(limits.cpu_s), str(limits.memory_bytes),
             str(limits.file_bytes), *_stdlib_roots(), site, "--", *packages],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            start_new_session=True, close_fds=True,
        )

        def kill() -> None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        out: list[bytes] = []
        err: list[bytes] = []
        overflow = threading.Event()
        half = limits.output_chars  # characters ~ bytes for the cap; decoded text is trimmed below
        readers = [threading.Thread(target=_drain, args=(child.stdout, half, out, overflow, kill), daemon=True),
                   threading.Thread(target=_drain, args=(child.stderr, half, err, overflow, kill), daemon=True)]
        for reader in readers:
            reader.start()
        try:
            child.stdin.write(code.encode("utf-8", "surrogatepass"))
            child.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = False
        try:
            child.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill()
            child.wait()
        kill()  # nothing of the run may outlive it
        for reader in readers:
            reader.join(timeout=5.0)
        stdout = b"".join(out).decode("utf-8", "replace")
        stderr = b"".join(err).decode("utf-8", "replace")
    return SandboxRun(stdout, stderr, child.returncode,
                      _diagnose(child.returncode, stderr, timed_out, overflow.is_set(), limits))


def _diagnose(code: int | None, stderr: str, timed_out: bool, overflow: bool, limits: SandboxLimits) -> str | None:
    if overflow:
        return f"the code printed more than {limits.output_chars} characters; print less"
    if timed_out:
        return f"the code ran longer than {limits.wall_s:g} s and was stopped"
    if code == 0:
        return None
    if code == VIOLATION_EXIT:
        reason = stderr.rsplit("sandbox violation:", 1)[-1].strip()
        return f"sandbox refused the code: {reason}"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"the code used more than {limits.cpu_s} s of CPU time and was stopped"
    if code == -signal.SIGXFSZ:
        return f"the code wrote a file larger than {limits.file_bytes} bytes"
    if code is not None and code < 0:
        return f"the code was killed by signal {signal.Signals(-code).name}"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {code}"
    if "MemoryError" in last:
        return f"the code ran out of memory (limit {limits.memory_bytes >> 20} MiB)"
    return f"the code failed: {last}\n{stderr.strip()[-2000:]}"


def python_interpreter_tool(arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolsConfig) -> ToolOutput:
    run = run_sandboxed(arguments["code"], SandboxLimits())
    if run.error is not None:
        raise ToolError(run.error)
    text = run.stdout if run.stdout.strip() else "(the code printed nothing; use print() to show results)"
    if run.stderr.strip():
        text += f"\n[stderr]\n{run.stderr}"
    return ToolOutput(text=text)


def python_interpreter_spec(limits: SandboxLimits = SandboxLimits()) -> ToolSpec:
    """The spec a profile registers when the interpreter is enabled (it never is by default)."""
    return ToolSpec(
        name="python_interpreter",
        description="Run Python 3 code in an isolated process without network or file system access "
        "beyond a scratch directory; the standard library and numpy are available. Only what the code "
        "prints is returned.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 1, "maxLength": limits.max_code_chars,
                                    "description": "Python source; use print() for results."}},
            "required": ["code"],
        },
        target="osvl.tools.python_interpreter:python_interpreter_tool",
        deadline_s=limits.wall_s + 5.0,
    )
