"""``python_interpreter``: run model-written Python behind an OS boundary (see :mod:`osvl.tools.sandbox`).

Off by default (a profile registers it only when asked). The spec carries its sandbox limits and
boundary as ``ToolSpec.options``, so what ``python_interpreter_spec(SandboxLimits(...), config)``
says is what every run in every worker applies. Every failure of the code (its exceptions, its
escape attempts, a limit it hit) is a ``tool_error`` with a message the model can read; a boundary
that cannot run here is an ``infra_error`` that says what to install or which setting to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from osvl.tools.config import ToolBackendsConfig
from osvl.tools.errors import BackendError, ToolError
from osvl.tools.registry import ToolOutput, ToolSpec
from osvl.tools.sandbox import SandboxConfig, SandboxLimits, SandboxRun, SandboxUnavailable, run_sandboxed

__all__ = [
    "SandboxConfig",
    "SandboxLimits",
    "SandboxRun",
    "python_interpreter_spec",
    "python_interpreter_tool",
    "run_sandboxed",
]

REFUSAL = (
    "python_interpreter refuses to run without its sandbox: {reason}. Install what is missing, choose "
    "another boundary (recipe key tools.python_sandbox = 'sandbox_fusion' with tools.sandbox_fusion_url), "
    "or accept running without one by setting tools.python_sandbox = 'unsafe_no_boundary'"
)


def python_interpreter_tool(
    arguments: Mapping[str, Any],
    images: list[np.ndarray],
    config: ToolBackendsConfig,
    limits: SandboxLimits = SandboxLimits(),
    sandbox: SandboxConfig = SandboxConfig(),
) -> ToolOutput:
    try:
        run = run_sandboxed(arguments["code"], limits, sandbox)
    except SandboxUnavailable as err:
        raise BackendError(REFUSAL.format(reason=err)) from None
    if run.error is not None:
        raise ToolError(run.error)
    text = run.stdout if run.stdout.strip() else "(the code printed nothing; use print() to show results)"
    if run.stderr.strip():
        text += f"\n[stderr]\n{run.stderr}"
    return ToolOutput(text=text)


def python_interpreter_spec(
    limits: SandboxLimits = SandboxLimits(), sandbox: SandboxConfig = SandboxConfig()
) -> ToolSpec:
    """The spec a profile registers when the interpreter is enabled (it never is by default)."""
    isolation = (
        "in an isolated sandbox without network, other processes or file system access beyond a scratch directory"
        if sandbox.backend != "unsafe_no_boundary"
        else "in a child process"
    )
    return ToolSpec(
        name="python_interpreter",
        description=f"Run Python 3 code {isolation}; the standard library and numpy are available. Only what "
        "the code prints is returned.",
        parameters={
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": limits.max_code_chars,
                    "description": "Python source; use print() for results.",
                }
            },
            "required": ["code"],
        },
        target="osvl.tools.python_interpreter:python_interpreter_tool",
        deadline_s=limits.wall_s + (sandbox.fusion_grace_s if sandbox.backend == "sandbox_fusion" else 5.0),
        options={"limits": limits, "sandbox": sandbox},
    )
