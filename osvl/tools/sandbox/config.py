"""What a ``python_interpreter`` run may use (``SandboxLimits``) and what keeps it in (``SandboxConfig``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("namespaces", "sandbox_fusion", "unsafe_no_boundary")


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits; every backend applies each one it can express (SandboxFusion: wall and memory)."""

    cpu_s: int = 5  # RLIMIT_CPU
    wall_s: float = 10.0  # killed after this, e.g. a sleeping loop
    memory_bytes: int = 512 << 20  # RLIMIT_AS; the bare interpreter needs ~30 MB, numpy ~60 MB
    file_bytes: int = 8 << 20  # RLIMIT_FSIZE: the largest file the code may write
    scratch_bytes: int = 32 << 20  # size of the private tmpfs, the only writable place
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 16  # RLIMIT_NPROC (threads; fork and exec'd children are refused by seccomp)
    output_chars: int = 8_000  # stdout + stderr read back; more is an error, not a truncation
    max_code_chars: int = 20_000

    def __post_init__(self) -> None:
        for name in (
            "cpu_s",
            "memory_bytes",
            "file_bytes",
            "scratch_bytes",
            "open_files",
            "processes",
            "output_chars",
            "max_code_chars",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.wall_s, (int, float)) and math.isfinite(self.wall_s) and self.wall_s > 0):
            raise ValueError(f"SandboxLimits.wall_s must be a positive number, got {self.wall_s!r}")


@dataclass(frozen=True)
class SandboxConfig:
    """Which boundary runs the code.

    ``namespaces`` (default, Linux): bubblewrap with fresh user/mount/PID/net/IPC/UTS namespaces, a
    seccomp filter and rlimits. ``sandbox_fusion``: a SandboxFusion service at ``fusion_url`` (for
    clusters without user namespaces). ``unsafe_no_boundary``: a plain child process guarded only by
    the Python audit hook; never a boundary, so it must be chosen by name.
    """

    backend: str = "namespaces"
    fusion_url: str = ""  # e.g. http://sandbox:8080 (POST {fusion_url}/run_code)
    fusion_grace_s: float = 10.0  # transport allowance on top of the run's wall clock
    bwrap: str = "bwrap"  # the bubblewrap executable (a name on PATH or a path)
    audit_hook: bool = True  # the Python-level fence inside the boundary (defence in depth)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"SandboxConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "sandbox_fusion" and not self.fusion_url.startswith(("http://", "https://")):
            raise ValueError(
                f"SandboxConfig: backend 'sandbox_fusion' needs an http(s) fusion_url, got {self.fusion_url!r}"
            )
        if not (math.isfinite(self.fusion_grace_s) and self.fusion_grace_s >= 0):
            raise ValueError(f"SandboxConfig.fusion_grace_s must be >= 0, got {self.fusion_grace_s}")


@dataclass
class SandboxRun:
    """What one run produced; ``error`` is None only for a clean exit within every limit."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    backend: str = ""


class SandboxUnavailable(RuntimeError):
    """The configured boundary cannot run here (missing bubblewrap, user namespaces disabled, service
    unreachable); the message says what to install or which setting to change."""
