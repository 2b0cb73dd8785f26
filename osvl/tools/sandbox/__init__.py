"""Running untrusted Python: behind an OS boundary (namespaces, SandboxFusion) or, by explicit opt-in
only, without one. :func:`run_sandboxed` never raises for anything the code does; a boundary that
cannot run raises :class:`SandboxUnavailable` (an infrastructure problem, not the policy's)."""

from __future__ import annotations

import functools
import logging

from osvl.tools.sandbox.config import BACKENDS, SandboxConfig, SandboxLimits, SandboxRun, SandboxUnavailable
from osvl.tools.sandbox.fusion import run_on_fusion
from osvl.tools.sandbox.namespaces import run_in_namespaces
from osvl.tools.sandbox.process import kill_session, own_sandbox_session
from osvl.tools.sandbox.unsafe import run_unsafe, sweep_stale_scratch

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "SandboxConfig",
    "SandboxLimits",
    "SandboxRun",
    "SandboxUnavailable",
    "check_sandbox",
    "kill_session",
    "own_sandbox_session",
    "run_sandboxed",
    "sweep_stale_scratch",
]


def run_sandboxed(
    code: str, limits: SandboxLimits = SandboxLimits(), config: SandboxConfig = SandboxConfig()
) -> SandboxRun:
    """Run ``code`` under ``limits`` behind ``config``'s boundary."""
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")  # noqa: TRY004 (bad input is a ValueError throughout osvl)
    if len(code) > limits.max_code_chars:
        return SandboxRun(
            "", "", None, f"the code is {len(code)} characters; the limit is {limits.max_code_chars}", config.backend
        )
    if config.backend == "namespaces":
        return run_in_namespaces(code, limits, config)
    if config.backend == "sandbox_fusion":
        return run_on_fusion(code, limits, config)
    _warn_unsafe()
    return run_unsafe(code, limits, config.audit_hook)


@functools.cache
def _warn_unsafe() -> None:
    log.warning(
        "python_interpreter runs model-written code WITHOUT an OS boundary (sandbox backend "
        "'unsafe_no_boundary'): only a Python audit hook stands between it and this machine"
    )


@functools.cache
def check_sandbox(config: SandboxConfig) -> None:
    """Run ``print(1)`` behind the configured boundary once per process; ``SandboxUnavailable`` (with what
    to install or set) when it cannot run. The unsafe backend passes, with a logged warning."""
    limits = SandboxLimits(cpu_s=5, wall_s=30.0)
    try:
        run = run_sandboxed("print(1)", limits, config)
    except SandboxUnavailable:
        raise
    except Exception as err:  # noqa: BLE001 - a service that cannot be reached is the same answer
        raise SandboxUnavailable(f"the {config.backend} sandbox failed its check: {err}") from None
    if run.error is not None or run.stdout.strip() != "1":
        raise SandboxUnavailable(f"the {config.backend} sandbox failed its check: {run.error or run.stdout!r}")
