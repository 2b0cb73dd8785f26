"""Tool specifications, the registry the prompt renders, and parsing a model's tool call.

A ``ToolSpec`` names its implementation as ``"module:function"`` so that spawned worker
processes can import it without pickling code. Implementations have the signature
``fn(arguments, images, config, **options) -> ToolOutput`` where ``images`` are the images named by
the spec's ``image_args``, resolved from the visual context in that order, and ``options`` are the
spec's own fixed settings (e.g. the interpreter's sandbox limits), never the policy's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from osvl.rl.trajectory import ToolCall
from osvl.tools.call_json import loads_call_json, reject_unusable
from osvl.tools.errors import CallParseError, InvalidArguments
from osvl.tools.limits import ToolLimits
from osvl.tools.schema import check_arguments, check_schema

# An implementation's address, importable in a spawned worker: "package.module:function"
TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def check_target(target: object, owner: str) -> None:
    """The one rule for a ``module:function`` target, shared by tool specs and pool preloads."""
    if not (isinstance(target, str) and TARGET.fullmatch(target)):
        raise ValueError(f"{owner}: target {target!r} must look like 'module:function'")


@dataclass
class ToolOutput:
    """What an implementation returns: observation text and any new images."""

    text: str = ""
    images: list[np.ndarray] = field(default_factory=list)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    target: str  # "package.module:function"
    image_args: tuple[str, ...] = ()  # integer arguments that index the visual context
    deadline_s: float = 30.0  # default per-call deadline
    cacheable: bool = False  # worth recording (online, slow, deterministic given inputs)
    options: Mapping[str, Any] = field(default_factory=dict)  # keyword arguments of every call (picklable)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"tool name {self.name!r} must be an identifier")
        check_target(self.target, f"tool {self.name}")
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"tool {self.name}: deadline_s must be a positive number, got {self.deadline_s}")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name}: parameters must be an object schema")
        check_schema(self.parameters, self.name)
        bad = [key for key in self.options if not (isinstance(key, str) and key.isidentifier())]
        if bad:
            raise ValueError(f"tool {self.name}: option names must be identifiers, got {bad}")
        for arg in self.image_args:
            if self.parameters["properties"].get(arg, {}).get("type") != "integer":
                raise ValueError(f"tool {self.name}: image argument {arg!r} must be an integer property")

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolRegistry:
    def __init__(self, specs: Iterable[ToolSpec], limits: ToolLimits | None = None) -> None:
        self.limits = limits or ToolLimits()
        self._specs: dict[str, ToolSpec] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise ValueError(f"tool {spec.name!r} is registered twice")
            self._specs[spec.name] = spec

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def get(self, name: str) -> ToolSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise CallParseError(f"unknown tool {name!r}; available tools: {', '.join(self._specs)}") from None

    def targets(self) -> tuple[str, ...]:
        """Each ``module:function`` target once, in registration order: what a pool preloads."""
        return tuple(dict.fromkeys(spec.target for spec in self._specs.values()))

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function-calling schemas, in registration order, as rendered into the prompt."""
        return [spec.openai_schema() for spec in self._specs.values()]

    def parse(self, raw: str | Mapping[str, Any] | ToolCall) -> ToolCall:
        """Turn the model's ``{"name": ..., "arguments": {...}}`` into a validated call.

        Raises ``CallParseError`` for malformed JSON or an unknown tool and ``InvalidArguments`` for
        arguments that cannot be decoded or validated. Defaults are filled in.
        """
        call = parse_tool_call(raw, self.limits)
        spec = self.get(call.name)
        return ToolCall(name=call.name, arguments=check_arguments(spec.parameters, call.arguments))


def _printable_name(name: Any) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_tool_call(raw: str | Mapping[str, Any] | ToolCall, limits: ToolLimits | None = None) -> ToolCall:
    """Parse without a registry: JSON shape, size limit, name and arguments object.

    Raises only ``CallParseError`` (the envelope: not JSON, not an object, no usable name) and
    ``InvalidArguments`` (arguments that cannot be decoded or are not an object)."""
    limits = limits or ToolLimits()
    if isinstance(raw, ToolCall):
        raw = {"name": raw.name, "arguments": raw.arguments}
    if isinstance(raw, str):
        if len(raw) > limits.max_call_chars:
            raise CallParseError(f"tool call is {len(raw)} characters; the limit is {limits.max_call_chars}")
        raw = loads_call_json(raw, "tool call")
    if not isinstance(raw, Mapping):
        raise CallParseError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    unknown = sorted(map(repr, set(raw) - {"name", "arguments"}))
    if unknown:
        raise CallParseError(f"tool call has unknown field(s) {', '.join(unknown)}; expected 'name' and 'arguments'")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise CallParseError("tool call needs a non-empty string 'name'")
    if len(name) > 200 or not _printable_name(name):
        raise CallParseError(f"unknown tool {name[:200]!r}")
    try:
        return ToolCall(name=name, arguments=_arguments(raw.get("arguments", {}), limits))
    except InvalidArguments as err:
        raise InvalidArguments(str(err), tool=name) from None


def _arguments(arguments: Any, limits: ToolLimits) -> dict[str, Any]:
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        if len(arguments) > limits.max_call_chars:
            raise InvalidArguments(f"arguments are {len(arguments)} characters; the limit is {limits.max_call_chars}")
        arguments = loads_call_json(arguments, "arguments", InvalidArguments) if arguments.strip() else {}
    if not isinstance(arguments, Mapping):
        raise InvalidArguments("tool call 'arguments' must be a JSON object")
    arguments = dict(arguments)
    reject_unusable(arguments, "")
    return arguments
