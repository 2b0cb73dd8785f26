"""Exceptions a tool raises inside its worker; the pool turns each into a typed status.

Who is at fault decides the status: the policy (``ToolError`` -> ``tool_error``, counts toward
the fatal rule) or our infrastructure (``BackendError`` -> ``infra_error``, never counts).
"""


class ToolError(Exception):
    """The call was well formed but cannot be served; the message is shown to the model."""


class CallParseError(Exception):
    """The action is not a call of a known tool with known arguments (``parse_error``)."""


class BackendError(Exception):
    """A service or model behind the tool failed (``infra_error``); not the policy's fault."""
