"""Which reader a training file needs when the recipe says ``data.format = "auto"``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from osvl.data.formats.sharegpt import ShareGPTColumns, _json_objects

PARQUET_MAGIC = b"PAR1"


def detect_format(path: str | os.PathLike[str], columns: ShareGPTColumns | None = None) -> str:
    """``verl_parquet`` (parquet magic bytes), ``sharegpt`` (the first JSON record holds the
    conversation column), ``text`` (its only key is ``text``) or ``osvl`` (anything else: the osvl
    reader reports what is wrong)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    with open(path, "rb") as handle:
        if handle.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC:
            return "verl_parquet"
    with open(path, encoding="utf-8", errors="replace") as handle:
        try:
            first = next(_json_objects(handle), None)
        except ValueError:
            return "osvl"
    messages = (columns or ShareGPTColumns()).messages
    if isinstance(first, Mapping) and messages in first:
        return "sharegpt"
    if isinstance(first, Mapping) and set(first) == {"text"}:
        return "text"
    return "osvl"
