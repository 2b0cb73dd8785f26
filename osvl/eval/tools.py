"""The tool back-ends an evaluation runs against, and the tool schema the checkpoint sees.

``--tools FILE.toml`` has one table per :class:`osvl.tools.ToolBackendsConfig` section (``limits``,
``http``, ``super_resolution``, ``ocr``, ``text_search``, ``image_search``) with that section's
field names. Secrets never appear in the file or on the command line: a field ``X_key`` or
``X_token`` is given as ``X_key_env = "VARIABLE"`` and read from the environment here, so configs
can be committed and shell history stays clean. Flags override the file; ``--world DIR`` fills in
the offline corpus and image collection when the file does not name them.

A released checkpoint was trained on the release's tool names (``--tool-profile release``): its
calls are translated to osvl's tools by :class:`EvalToolEnvironment` and results are presented
back in its own image-reference style.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

from osvl.tools import profiles
from osvl.tools.config import (
    HttpConfig,
    ImageSearchConfig,
    OcrConfig,
    SuperResolutionConfig,
    TextSearchConfig,
    ToolBackendsConfig,
)
from osvl.tools.environment import ToolEnvironment
from osvl.tools.limits import ToolLimits
from osvl.tools.profiles import ToolProfile

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
    """The TOML file as ``{section: {field: value}}``, checked against the config's field names."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tools config not found: {path}")
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


def check_offline_paths(config: ToolBackendsConfig) -> None:
    """An offline search back-end without its data would fail every call; say so before the run."""
    for section, path, what in (
        ("text_search", config.text_search.corpus_path, "corpus_path (corpus.jsonl)"),
        ("image_search", config.image_search.collection_path, "collection_path (images.jsonl)"),
    ):
        if getattr(config, section).backend == "offline":
            if not path:
                raise ValueError(
                    f"{section} is offline but has no {what}: pass --world DIR, set it in --tools, "
                    f"or use the online back-end"
                )
            if not Path(path).is_file():
                raise ValueError(f"{section} {what.split()[0]} not found: {path}")


class EvalToolEnvironment(profiles.ProfiledEnvironment):
    """The agentic modes' environment in ``profile``'s schema, keeping the osvl-protocol ``env`` it
    runs on for RAG, which issues osvl's own ``text_search`` calls whatever the checkpoint's profile."""

    def __init__(self, env: ToolEnvironment, profile: ToolProfile) -> None:
        super().__init__(profile, env.pool, env.cache)
        self.env = env


# command-line flag (argparse dest) -> (section, field); a *_key_env flag names a variable, never a key
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "text_search_backend": ("text_search", "backend"),
    "serper_url": ("text_search", "serper_url"),
    "serper_key_env": ("text_search", "serper_key_env"),
    "jina_url": ("text_search", "jina_url"),
    "jina_key_env": ("text_search", "jina_key_env"),
    "summarizer_url": ("text_search", "summarizer_url"),
    "summarizer_model": ("text_search", "summarizer_model"),
    "summarizer_key_env": ("text_search", "summarizer_key_env"),
    "image_search_backend": ("image_search", "backend"),
    "image_search_url": ("image_search", "api_url"),
    "image_search_key_env": ("image_search", "api_key_env"),
    "image_upload_url": ("image_search", "upload_url"),
}


def tool_sections(file: str | None, flags: Mapping[str, Any], world: str | None) -> dict[str, dict[str, Any]]:
    """The file's sections with the given flags on top and the world's offline data as defaults."""
    sections = read_tools_file(file) if file else {}
    for dest, (section, field) in FLAG_FIELDS.items():
        if flags.get(dest) is not None:
            sections.setdefault(section, {})[field] = flags[dest]
    if world:
        root = Path(world)
        sections.setdefault("text_search", {}).setdefault("corpus_path", str(root / "corpus.jsonl"))
        sections.setdefault("image_search", {}).setdefault("collection_path", str(root / "images.jsonl"))
    return sections
