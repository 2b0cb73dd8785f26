"""RL prompt parquet files (the released SearchVL RL set) -> osvl :class:`Prompt` records.

Two row layouts are understood:

* verl's: ``prompt`` (chat messages; the question is the last user message, ``<image>``
  placeholders removed), ``images`` (``{"bytes", "path"}`` structs or raw bytes),
  ``reward_model.ground_truth`` (a string, or a list whose first item is the answer and the rest
  aliases), optional ``extra_info.index`` as the id;
* the release's HuggingFace layout: ``question``, ``answer``, ``image`` (encoded bytes, or a
  ``{"bytes"}`` struct) or ``images``, optional ``id``.

Rows stream in parquet batches; a row that cannot become a prompt is counted in the statistics
with its reason and skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from osvl.data.formats.records import FileStats, Rejected, decode_image_bytes
from osvl.rl.trajectory import Prompt

IMAGE_PLACEHOLDER = "<image>"


def _image(value: Any, what: str) -> np.ndarray:
    if isinstance(value, Mapping):
        value = value.get("bytes")
    if isinstance(value, (bytes, bytearray)):
        return decode_image_bytes(bytes(value), what)
    raise Rejected("bad image", f"{what} has no encoded bytes (got {type(value).__name__})")


def _question(messages: Any) -> str:
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list):
        raise Rejected("bad prompt", f"prompt must be a list of messages, got {type(messages).__name__}")
    users = [m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise Rejected("bad prompt", "prompt has no user message with string content")
    return users[-1]


def _answers(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [str(value)]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise Rejected("bad answer", f"ground truth must be a string or a list of strings, got {value!r:.80}")


def rl_prompt(row: Mapping[str, Any], default_id: str) -> Prompt:
    """One parquet row -> a :class:`Prompt`; raises :class:`Rejected` with the reason."""
    if "prompt" in row:
        question = _question(row["prompt"])
        ground_truth = (row.get("reward_model") or {}).get("ground_truth")
        extra = row.get("extra_info") or {}
        record_id = row.get("id") or (extra.get("index") if isinstance(extra, Mapping) else None)
    elif "question" in row:
        question, ground_truth, record_id = row["question"], row.get("answer"), row.get("id")
    else:
        raise Rejected("unknown layout", f"row has neither 'prompt' nor 'question' (columns: {sorted(row)})")
    if not isinstance(question, str) or not question.replace(IMAGE_PLACEHOLDER, "").strip():
        raise Rejected("empty question", "the question is empty")
    if ground_truth is None:
        raise Rejected("no answer", "the row has no ground-truth answer")
    answers = _answers(ground_truth)
    raw_images = row.get("images")
    if raw_images is None and row.get("image") is not None:
        raw_images = [row["image"]]
    raw_images = raw_images or []
    if not isinstance(raw_images, list):
        raise Rejected("bad image", f"images must be a list, got {type(raw_images).__name__}")
    images = [_image(value, f"image {i}") for i, value in enumerate(raw_images)]
    placeholders = question.count(IMAGE_PLACEHOLDER)
    if placeholders and placeholders != len(images):
        raise Rejected("image count mismatch", f"{placeholders} placeholders, {len(images)} images")
    return Prompt(
        id=str(record_id if record_id is not None else default_id),
        question=question.replace(IMAGE_PLACEHOLDER, "").strip(),
        images=images,
        answer=answers[0],
        aliases=answers[1:],
    )


def iter_rl_parquet(
    path: str | os.PathLike[str], stats: FileStats | None = None, batch_rows: int = 256
) -> Iterator[Prompt]:
    """Stream prompts from a parquet file, ``batch_rows`` rows in memory at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"parquet file {path} does not exist")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    stats = stats if stats is not None else FileStats(str(path))
    try:
        source = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"{path} is not a readable parquet file: {err}") from None
    index = 0
    for batch in source.iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            try:
                prompt = rl_prompt(row, f"{path.stem}:{index}")
            except Rejected as error:
                stats.reject(index, error)
            else:
                stats.records += 1
                stats.images += len(prompt.images)
                yield prompt
            index += 1
