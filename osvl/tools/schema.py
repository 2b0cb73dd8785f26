"""A strict validator for the JSON-schema subset our tool signatures use.

The same schema is rendered into the prompt, so the error messages are written for the model:
they name the argument path and what was expected. Every way arguments can fail (unknown or
missing names, wrong type, out of range, non-finite, integers beyond what JSON carries exactly,
text that is not valid Unicode) raises ``InvalidArguments``; no other exception leaves
``check_arguments``, whatever Python object it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from osvl.tools.errors import InvalidArguments

_SUPPORTED_KEYS = frozenset(
    {
        "type",
        "description",
        "properties",
        "required",
        "additionalProperties",
        "enum",
        "default",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "items",
        "minItems",
        "maxItems",
    }
)
_TYPES = ("object", "array", "string", "integer", "number", "boolean")
MAX_SAFE_INTEGER = 2**53  # integers beyond this do not survive a JSON round trip through a double (RFC 7493)


def check_schema(schema: Mapping[str, Any], path: str = "$") -> None:
    """Reject schema keywords this validator would silently ignore."""
    unknown = set(schema) - _SUPPORTED_KEYS
    if unknown:
        raise ValueError(f"schema at {path} uses unsupported keywords {sorted(unknown)}")
    if schema.get("type") not in _TYPES:
        raise ValueError(f"schema at {path} needs a type in {_TYPES}, got {schema.get('type')!r}")
    for name, sub in schema.get("properties", {}).items():
        check_schema(sub, f"{path}.{name}")
    if "items" in schema:
        check_schema(schema["items"], f"{path}[]")
    missing = set(schema.get("required", ())) - set(schema.get("properties", {}))
    if missing:
        raise ValueError(f"schema at {path} requires undeclared properties {sorted(missing)}")


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> dict[str, Any]:
    """Validate a call's arguments and return them with defaults filled in."""
    if not isinstance(arguments, Mapping):
        raise InvalidArguments(f"arguments must be a JSON object, got {_json_type(arguments)}")
    properties = schema.get("properties", {})
    unknown = sorted(repr(name) for name in arguments if name not in properties)
    if unknown:
        raise InvalidArguments(f"unknown argument(s) [{', '.join(unknown)}]; allowed: {sorted(properties)}")
    missing = [name for name in schema.get("required", ()) if name not in arguments]
    if missing:
        raise InvalidArguments(f"missing required argument(s) {missing}")
    filled = {name: sub["default"] for name, sub in properties.items() if "default" in sub and name not in arguments}
    for name, value in arguments.items():
        filled[name] = _check_value(properties[name], value, name)
    return filled


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _check_value(schema: Mapping[str, Any], value: Any, path: str) -> Any:
    kind = schema["type"]
    actual = _json_type(value)
    if actual == "integer" and abs(value) > MAX_SAFE_INTEGER:
        digits = int(value.bit_length() * math.log10(2)) + 1  # str() refuses integers of 4300+ digits
        raise InvalidArguments(f"argument '{path}' is an integer of about {digits} digits, out of range")
    if kind == "number" and actual == "integer":
        value = float(value)
    elif kind == "integer" and actual == "number" and math.isfinite(value) and float(value).is_integer():
        value = int(value)
        if abs(value) > MAX_SAFE_INTEGER:
            raise InvalidArguments(f"argument '{path}' is out of range, got {value:g}")
    elif actual != kind:
        raise InvalidArguments(f"argument '{path}' must be {_article(kind)} {kind}, got {actual}")
    if kind == "number" and not math.isfinite(value):
        raise InvalidArguments(f"argument '{path}' must be a finite number, got {value!r}")
    if kind == "string":
        _check_text(value, path)
    if "enum" in schema and value not in schema["enum"]:
        raise InvalidArguments(f"argument '{path}' must be one of {schema['enum']}, got {value!r}")
    if kind in ("number", "integer"):
        if "minimum" in schema and value < schema["minimum"]:
            raise InvalidArguments(f"argument '{path}' must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            raise InvalidArguments(f"argument '{path}' must be <= {schema['maximum']}, got {value}")
    elif kind == "string":
        if len(value) > schema.get("maxLength", math.inf):
            raise InvalidArguments(f"argument '{path}' is {len(value)} characters; the limit is {schema['maxLength']}")
        if len(value) < schema.get("minLength", 0):
            raise InvalidArguments(f"argument '{path}' must have at least {schema['minLength']} character(s)")
    elif kind == "array":
        if len(value) > schema.get("maxItems", math.inf):
            raise InvalidArguments(f"argument '{path}' has {len(value)} items; the limit is {schema['maxItems']}")
        if len(value) < schema.get("minItems", 0):
            raise InvalidArguments(f"argument '{path}' needs at least {schema['minItems']} item(s), got {len(value)}")
        value = [_check_value(schema["items"], item, f"{path}[{i}]") for i, item in enumerate(value)]
    elif kind == "object":
        value = _check_nested_object(schema, value, path)
    return value


def _check_text(value: str, path: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArguments(
            f"argument '{path}' is not valid Unicode text (a lone surrogate at character {err.start})"
        ) from None


def _check_nested_object(schema: Mapping[str, Any], value: Mapping[str, Any], path: str) -> dict[str, Any]:
    properties = schema.get("properties", {})
    unknown = sorted(repr(name) for name in value if name not in properties)
    if unknown:
        raise InvalidArguments(f"argument '{path}' has unknown field(s) [{', '.join(unknown)}]")
    missing = [name for name in schema.get("required", ()) if name not in value]
    if missing:
        raise InvalidArguments(f"argument '{path}' is missing field(s) {missing}")
    return {name: _check_value(properties[name], item, f"{path}.{name}") for name, item in value.items()}


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"
