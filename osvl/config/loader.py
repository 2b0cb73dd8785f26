"""TOML recipe -> typed ``Recipe``: unknown keys and wrong types are errors naming the key path.

Overrides (``--set grpo.eps_high=0.3``) are applied to the raw tree before validation, so an
override is checked exactly like the file; values parse as TOML literals (``3``, ``0.5``,
``true``, ``[1, 2]``), and a ``str`` field takes the text as written.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from osvl.config.packaged import PACKAGE_DIR, packaged_toml
from osvl.config.recipe import Recipe

RECIPES_DIR = PACKAGE_DIR / "recipes"


def resolve_recipe_path(name: str | Path) -> Path:
    """A recipe name (``grpo_8b``) from ``osvl/recipes/`` or a path to a TOML file."""
    return packaged_toml(name, "recipes", "recipe")


def read_prompt_file(path: str | Path, key: str) -> str:
    """The stripped text of a prompt file that config key or flag ``key`` names; errors name the key."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{key} file not found: {file}")
    text = file.read_text(encoding="utf-8").strip()
    if not text:
        raise ValueError(f"{key} file {file} is empty")
    return text


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a table, got {value!r}")
        return build(tp, value, path)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{path}: {value!r} is not one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        for option in options:
            try:
                return _coerce(value, option, path)
            except ValueError:
                continue
        unset = " (or leave the key out)" if len(options) < len(args) else ""
        raise ValueError(
            f"{path}: value of the wrong type: expected {' or '.join(map(_type_name, options))}{unset}, got {value!r}"
        )
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected an array, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{path}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported config field type {tp!r}")


def _all_keys(cls: Any = None, prefix: str = "") -> list[str]:
    """Every leaf key path of the recipe (``grpo.eps_high``, ...)."""
    cls = Recipe if cls is None else cls
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        path = f"{prefix}{name}"
        keys += _all_keys(tp, f"{path}.") if dataclasses.is_dataclass(tp) else [path]
    return keys


def did_you_mean(key: str, accepted: Iterable[str], where: str = "") -> str:
    """`` (did you mean X?)`` for a mistyped ``key``: the close names ``accepted`` in its own table (``where``), else
    the keys of other tables with that exact name (``grpo.lr`` -> ``optimizer.lr``); "" when none is near."""
    near = difflib.get_close_matches(key, list(accepted), n=2, cutoff=0.75)
    if near:
        return f" (did you mean {' or '.join(where + n for n in near)}?)"
    elsewhere = [k for k in _all_keys() if k.rsplit(".", 1)[-1] == key and k != where + key]
    return f" (did you mean {' or '.join(elsewhere[:3])}?)" if elsewhere else ""


def build(cls: type, raw: Mapping[str, Any], path: str = "") -> Any:
    """Construct dataclass ``cls`` from a raw mapping, checking every key and type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(
            f"unknown key(s) {', '.join(where + k + did_you_mean(k, fields, where) for k in unknown)}; "
            f"{path or 'recipe'} accepts: {', '.join(sorted(fields))}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except ValueError as error:
        raise ValueError(f"{path}: {error}" if path else str(error)) from None


def _field_type(path: str) -> Any:
    cls: Any = Recipe
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"--set {path}: {'.'.join(parts[:i])} is not a table")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            where = "".join(f"{p}." for p in parts[:i])
            raise ValueError(
                f"--set {path}: unknown key {'.'.join(parts[: i + 1])}{did_you_mean(part, hints, where)}; "
                f"accepts: {', '.join(sorted(hints))}"
            )
        cls = hints[part]
    return cls


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=c"`` -> ``("a.b", value)`` with the value parsed for the field's type."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected key=value")
    path, raw = (s.strip() for s in text.split("=", 1))
    tp = _field_type(path)
    if dataclasses.is_dataclass(tp):
        raise ValueError(f"--set {path}: is a table; set one of its keys")
    if tp is str:
        return path, raw
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``raw`` with each ``key=value`` set (tables are created as needed)."""
    tree = _deep_copy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = tree
        *tables, leaf = path.split(".")
        for table in tables:
            node = node.setdefault(table, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {path}: {table} is not a table in the recipe")
        node[leaf] = value
    return tree


def _deep_copy(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def load_recipe(name: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe; raises ``ValueError`` before anything starts."""
    path = resolve_recipe_path(name)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    try:
        return build(Recipe, apply_overrides(raw, overrides))
    except ValueError as error:
        raise ValueError(f"recipe {path.name}: {error}") from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain dict (tuples as lists) for run_dir/recipe.json and the metrics header."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(recipe))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ("-inf" if value < 0 else "inf") if value in (float("inf"), float("-inf")) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def recipe_toml(recipe: Recipe) -> str:
    """The resolved recipe (every default and override in place) as TOML that loads back to the same recipe."""
    lines = []
    for section, values in recipe_to_dict(recipe).items():
        lines += [f"[{section}]", *(f"{key} = {_toml_value(value)}" for key, value in values.items()), ""]
    return "\n".join(lines)
