"""Plain text for continued pretraining: a JSONL of ``{"text": ...}`` records, loss on every token.

The SFT stage reads it as ``data.format = "text"``: each record is one document (no chat
template, no masking), ended by ``<|endoftext|>``. A document longer than the packing budget is
cut into consecutive windows rather than dropped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from osvl.data.formats.records import FileStats, Rejected
from osvl.data.tokenizer import Tokenizer
from osvl.jsonl import iter_jsonl


def iter_text(path: str | os.PathLike[str], stats: FileStats | None = None) -> Iterator[str]:
    """The documents of a text JSONL file; records without a non-empty string ``text`` are counted
    in ``stats`` and skipped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"text file {path} does not exist")
    stats = stats if stats is not None else FileStats(str(path))
    for number, record in iter_jsonl(path):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            stats.reject(number, Rejected("no text", f"line {number} has no non-empty string 'text' field"))
            continue
        stats.records += 1
        yield text


def text_windows(text: str, tokenizer: Tokenizer, max_tokens: int) -> list[np.ndarray]:
    """A document's ids plus ``<|endoftext|>``, cut into windows of at most ``max_tokens``."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 to hold a prediction, got {max_tokens}")
    ids = np.asarray(tokenizer.encode(text) + [tokenizer.special.endoftext], dtype=np.int64)
    windows = (ids[start : start + max_tokens] for start in range(0, len(ids), max_tokens))
    return [window for window in windows if len(window) >= 2]  # a lone last token predicts nothing
