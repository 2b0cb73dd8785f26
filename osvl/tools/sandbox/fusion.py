"""``sandbox_fusion``: run the code on a SandboxFusion service (the sandbox verl uses) by URL.

``POST {url}/run_code`` with ``{"code", "language": "python", "run_timeout", "compile_timeout",
"memory_limit_MB", "stdin", "files", "fetch_files"}``; the answer's ``status`` is ``Success``,
``Failed`` (the code's fault) or ``SandboxError`` (the service's), and ``run_result`` holds
``status`` (``Finished`` / ``TimeLimitExceeded`` / ``Error``), ``return_code``, ``stdout`` and
``stderr``. The service's own isolation is the boundary; its outages are ``BackendError`` (infra).
"""

from __future__ import annotations

from typing import Any

from osvl.tools.config import HttpConfig
from osvl.tools.errors import BackendError
from osvl.tools.http_client import request_json
from osvl.tools.sandbox.config import SandboxConfig, SandboxLimits, SandboxRun
from osvl.tools.sandbox.process import ChildOutcome, diagnose

SERVICE = "SandboxFusion"


def fusion_request(code: str, limits: SandboxLimits) -> dict[str, Any]:
    return {
        "code": code,
        "language": "python",
        "run_timeout": limits.wall_s,
        "compile_timeout": limits.wall_s,
        "memory_limit_MB": max(1, limits.memory_bytes >> 20),
        "stdin": "",
        "files": {},
        "fetch_files": [],
    }


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def run_on_fusion(code: str, limits: SandboxLimits, config: SandboxConfig) -> SandboxRun:
    http = HttpConfig(timeout_s=limits.wall_s + config.fusion_grace_s, max_retries=1)
    reply = request_json(
        SERVICE, "POST", f"{config.fusion_url.rstrip('/')}/run_code", http, json_body=fusion_request(code, limits)
    )
    if not isinstance(reply, dict) or reply.get("status") not in ("Success", "Failed", "SandboxError"):
        raise BackendError(f"{SERVICE} answered without a known status: {str(reply)[:200]}")
    run = reply.get("run_result")
    if reply["status"] == "SandboxError" or not isinstance(run, dict):
        raise BackendError(f"{SERVICE} could not run the code: {_text(reply.get('message'))[:500] or 'no message'}")
    if run.get("status") == "Error":
        raise BackendError(f"{SERVICE} failed to run the code: {_text(run.get('stderr'))[:500]}")
    stdout, stderr = _text(run.get("stdout")), _text(run.get("stderr"))
    code_ = run.get("return_code")
    outcome = ChildOutcome(
        stdout[: limits.output_chars],
        stderr[: limits.output_chars],
        code_ if isinstance(code_, int) and not isinstance(code_, bool) else None,
        timed_out=run.get("status") == "TimeLimitExceeded",
        overflow=len(stdout) > limits.output_chars or len(stderr) > limits.output_chars,
    )
    if outcome.exit_code is None and not outcome.timed_out:
        raise BackendError(f"{SERVICE} reported no return code for a finished run")
    return SandboxRun(
        outcome.stdout,
        outcome.stderr,
        outcome.exit_code,
        diagnose(outcome, limits, signal_base=128),
        backend="sandbox_fusion",
    )
