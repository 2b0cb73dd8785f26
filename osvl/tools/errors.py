"""Exceptions a tool raises inside its worker; the pool turns each into a typed status.

Who is at fault decides the status: the policy (``ToolError`` -> ``tool_error``,
``InvalidArguments`` -> ``invalid_arguments``, ``CallParseError`` -> ``parse_error``; all count
toward the fatal rule) or our infrastructure (``BackendError`` -> ``infra_error``, never counts).
"""

from __future__ import annotations

from osvl.rl.trajectory import ToolStatus


class ToolError(Exception):
    """The call was well formed but cannot be served; the message is shown to the model."""


class InvalidArguments(ToolError):
    """The arguments cannot be decoded or validated (huge or non-finite numbers, nesting too deep,
    lone surrogates, wrong types, out of range, unknown or missing names). ``tool`` names the tool
    when the failure was found while its call was still being parsed."""

    def __init__(self, message: str, tool: str = "") -> None:
        super().__init__(message)
        self.tool = tool


class CallParseError(Exception):
    """The action is not a call of a known tool (``parse_error``): not JSON, not an object, no name."""


class BackendError(Exception):
    """A service or model behind the tool failed (``infra_error``); not the policy's fault."""


def error_status(error: BaseException) -> ToolStatus | None:
    """The status an exception stands for, or None for one that is nobody's declared outcome (a bug)."""
    if isinstance(error, InvalidArguments):
        return ToolStatus.INVALID_ARGUMENTS
    if isinstance(error, ToolError):
        return ToolStatus.TOOL_ERROR
    if isinstance(error, CallParseError):
        return ToolStatus.PARSE_ERROR
    if isinstance(error, BackendError):
        return ToolStatus.INFRA_ERROR
    return None
