"""Decoding JSON the model wrote (a tool call, its arguments) into values or typed errors.

``json.loads`` alone raises ``ValueError`` for integers of 4300+ digits, ``RecursionError`` for deep
nesting, and accepts ``NaN``/``Infinity`` and numbers that overflow to ``inf``: none of that may
reach a tool or crash a rollout.
"""

from __future__ import annotations

import json
import math
from typing import Any

from osvl.tools.errors import CallParseError, InvalidArguments

MAX_NUMBER_CHARS = 40  # a JSON number token longer than this is no argument any tool takes


class UnusableNumber(str):
    """A JSON number no tool can take (too long to convert, or non-finite), kept as its source text.

    Decoding goes on so that :func:`reject_unusable` can name the argument that holds it
    (``InvalidArguments``) instead of failing the whole call without saying where."""

    why: str


def _unusable(token: str, why: str) -> UnusableNumber:
    number = UnusableNumber(token if len(token) <= MAX_NUMBER_CHARS else f"{token[:12]}...")
    number.why = why
    return number


def _parse_int(token: str) -> int | UnusableNumber:
    if len(token) > MAX_NUMBER_CHARS:
        return _unusable(token, f"an integer of {len(token.lstrip('-'))} digits, out of range")
    return int(token)


def _parse_float(token: str) -> float | UnusableNumber:
    value = float(token) if len(token) <= MAX_NUMBER_CHARS else math.inf
    if not math.isfinite(value):
        return _unusable(token, f"the number {token[:12]}{'...' if len(token) > 12 else ''}, out of range")
    return value


def _parse_constant(token: str) -> UnusableNumber:
    return _unusable(token, f"the non-finite number {token}, which is not valid JSON")


def loads_call_json(text: str, what: str, syntax_error: type[Exception] = CallParseError) -> Any:
    """``json.loads`` for model-written JSON: syntax errors raise ``syntax_error`` (``CallParseError`` for
    a whole call, ``InvalidArguments`` for an arguments string), nesting too deep is ``InvalidArguments``;
    numbers no tool can take decode to ``UnusableNumber`` (for :func:`reject_unusable`). Nothing else
    escapes."""
    try:
        return json.loads(text, parse_constant=_parse_constant, parse_int=_parse_int, parse_float=_parse_float)
    except json.JSONDecodeError as err:
        raise syntax_error(f"{what} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise InvalidArguments(f"{what} is nested too deeply") from None


def reject_unusable(value: Any, path: str) -> None:
    """``InvalidArguments`` naming the first ``UnusableNumber`` inside decoded ``value``, so no consumer,
    schema-checked or not, ever receives one."""
    try:
        _reject_unusable(value, path)
    except RecursionError:
        raise InvalidArguments(f"argument '{path}' is nested too deeply") from None


def _reject_unusable(value: Any, path: str) -> None:
    if isinstance(value, UnusableNumber):
        raise InvalidArguments(f"argument '{path}' is {value.why}")
    if isinstance(value, dict):
        for key, item in value.items():
            _reject_unusable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_unusable(item, f"{path}[{i}]")
