"""What every reader shares: per-file statistics, rejection records, image decoding."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from osvl.data.image import decode_image


class Rejected(ValueError):
    """A record the reader skips; ``reason`` is the short category counted in the statistics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class FileStats:
    """One input file: how much came out, and what was skipped and why."""

    path: str
    records: int = 0  # accepted trajectories or prompts
    turns: int = 0  # policy steps over accepted trajectories
    tool_calls: int = 0
    images: int = 0  # prompt + observation images decoded
    tokens: int = 0  # policy tokens (only when a tokenizer was given)
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    examples: dict[str, str] = field(default_factory=dict)  # reason -> first "record N: detail"

    def reject(self, index: int, error: Rejected) -> None:
        self.rejected[error.reason] += 1
        self.examples.setdefault(error.reason, f"record {index}: {error.detail}")

    @property
    def tool_calls_per_trajectory(self) -> float:
        return self.tool_calls / self.records if self.records else 0.0

    @property
    def turns_per_trajectory(self) -> float:
        return self.turns / self.records if self.records else 0.0

    def summary(self) -> dict[str, object]:
        return {
            "path": self.path,
            "records": self.records,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_calls_per_trajectory": round(self.tool_calls_per_trajectory, 3),
            "turns_per_trajectory": round(self.turns_per_trajectory, 3),
            "images": self.images,
            "tokens": self.tokens,
            "rejected": dict(self.rejected),
            "examples": dict(self.examples),
        }


def decode_image_bytes(data: bytes, what: str) -> np.ndarray:
    """Encoded PNG/JPEG/... bytes -> uint8 RGB (H, W, 3); bounded before decoding (``decode_image``)."""
    try:
        return decode_image(data)
    except ValueError as error:
        raise Rejected("bad image", f"{what} cannot be decoded as an image: {error}") from None


def load_image_file(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> np.ndarray:
    """An image path from a dataset: absolute, or relative to the dataset's root directory."""
    full = Path(path) if Path(path).is_absolute() else Path(root) / path
    if not full.is_file():
        raise Rejected("missing image", f"{full} does not exist")
    return decode_image_bytes(full.read_bytes(), str(full))
