"""The TOML file of the tool back-ends (``tools.config_file``, ``osvl.eval --tools``,
``osvl.tools.server --tools``): one table per :class:`osvl.tools.ToolBackendsConfig` section
(``limits``, ``http``, ``super_resolution``, ``ocr``, ``text_search``, ``image_search``) with that
section's field names.

Secrets never appear in the file or on a command line: a field ``X_key`` or ``X_token`` is given as
``X_key_env = "VARIABLE"`` and read from the environment here, so the file can be committed and
shell history stays clean.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from osvl.config.packaged import packaged_toml
from osvl.tools.config import (
    HttpConfig,
    ImageSearchConfig,
    OcrConfig,
    SuperResolutionConfig,
    TextSearchConfig,
    ToolBackendsConfig,
)
from osvl.tools.limits import ToolLimits

SECTIONS: dict[str, type] = {
    "limits": ToolLimits,
    "http": HttpConfig,
    "super_resolution": SuperResolutionConfig,
    "ocr": OcrConfig,
    "text_search": TextSearchConfig,
    "image_search": ImageSearchConfig,
}
SECRET_SUFFIXES = ("_key", "_token")


def _is_secret(name: str) -> bool:
    return name.endswith(SECRET_SUFFIXES)


def read_tools_file(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The TOML file (a path, or the name of a shipped one: ``online``) as ``{section: {field: value}}``,
    checked against the config's field names."""
    path = packaged_toml(path, "recipes/tools", "tools config")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path} is not valid TOML: {error}") from None
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    sections: dict[str, dict[str, Any]] = {}
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [{name}] must be a table")  # noqa: TRY004 (bad input is a ValueError throughout osvl)
        sections[name] = dict(table)
    return sections


def resolve_sections(
    sections: Mapping[str, Mapping[str, Any]], environ: Mapping[str, str] | None = None
) -> ToolBackendsConfig:
    """``{section: {field: value}}`` (``X_key_env`` naming variables) -> a validated ToolBackendsConfig."""
    environ = os.environ if environ is None else environ
    built: dict[str, Any] = {}
    for name, values in sections.items():
        if name not in SECTIONS:
            raise ValueError(f"unknown tools section {name!r}; known: {', '.join(SECTIONS)}")
        fields = {f.name for f in dataclasses.fields(SECTIONS[name])}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if value is None:
                continue
            if key.endswith("_env") and _is_secret(key.removesuffix("_env")) and key.removesuffix("_env") in fields:
                secret = environ.get(str(value))
                if not secret:
                    raise ValueError(f"[{name}] {key} names environment variable {value!r}, which is not set")
                kwargs[key.removesuffix("_env")] = secret
            elif _is_secret(key) and key in fields:
                raise ValueError(
                    f"[{name}] {key}: secrets are not read from files or flags; set {key}_env to the "
                    "name of an environment variable holding it"
                )
            elif key in fields:
                kwargs[key] = value
            else:
                known = sorted(f"{f}_env" if _is_secret(f) else f for f in fields)
                raise ValueError(f"[{name}] unknown field {key!r}; known: {', '.join(known)}")
        try:
            built[name] = SECTIONS[name](**kwargs)
        except TypeError as error:
            raise ValueError(f"[{name}] {error}") from None
    return ToolBackendsConfig(**built)


def online_tools_config(path: str) -> ToolBackendsConfig:
    """The online back-ends of ``tools.config_file`` (keys come from the environment variables its
    ``*_key_env`` fields name)."""
    if not path:
        raise ValueError(
            "tools.backend = 'online' needs tools.config_file (a TOML with the online back-ends, "
            "keys named by *_key_env fields) or tools.servers (tool servers that hold them)"
        )
    try:
        return resolve_sections(read_tools_file(path))
    except ValueError as error:
        raise ValueError(f"tools.config_file: {error}") from None
