"""JSON Lines files: the one reading loop and one writer that osvl's record files go through.

Blank lines are skipped and a bad line is a ``ValueError`` naming the file and line, so a corrupt
record in a million-line corpus is found by its address, not by a bare decode error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """``(line number, decoded value)`` for each non-blank line of ``path``, numbered from 1."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            yield number, value


def iter_records(path: str | os.PathLike[str], from_dict: Callable[[dict[str, Any]], T]) -> Iterator[T]:
    """Each line's object through ``from_dict``; its ``ValueError`` gains the file and line."""
    for number, data in iter_jsonl(path):
        if not isinstance(data, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object")  # noqa: TRY004 (bad input)
        try:
            yield from_dict(data)
        except ValueError as bad:
            raise ValueError(f"{path}:{number}: {bad}") from None


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Any], *, append: bool = False) -> int:
    """One JSON line per row with sorted keys, so the same rows give the same bytes; returns how many."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "a" if append else "w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
    return count
