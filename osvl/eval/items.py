"""The benchmark item every loader converts to, and how its images are read at run time.

Images stay references (an absolute file path or a ``data:`` URI) until an item is evaluated, so
loading a benchmark of thousands of items costs no pixel memory.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from osvl.data.image import decode_image
from osvl.rl.trajectory import Prompt


@dataclass(frozen=True)
class EvalItem:
    """One benchmark question with its accepted answers (``answers[0]`` is the reference)."""

    benchmark: str
    id: str
    question: str
    answers: tuple[str, ...]
    images: tuple[str, ...] = ()  # absolute paths or data: URIs
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id or not self.question.strip():
            raise ValueError(f"{self.benchmark}: an item needs a non-empty id and question")
        if not any(a.strip() for a in self.answers):
            raise ValueError(f"{self.benchmark}/{self.id}: an item needs at least one reference answer")

    @property
    def key(self) -> str:
        """Unique across benchmarks: records are resumed by this key."""
        return f"{self.benchmark}/{self.id}"


def read_image_ref(ref: str) -> np.ndarray:
    """RGB uint8 pixels of a path or ``data:image/...;base64,`` reference."""
    if ref.startswith("data:"):
        _, sep, payload = ref.partition(",")
        if not sep:
            raise ValueError("data: image URI without a ',' separator")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"invalid base64 image data: {error}") from None
        return decode_image(data)
    path = Path(ref)
    if not path.is_file():
        raise ValueError(f"image file not found: {path}")
    return decode_image(path.read_bytes())


def to_prompt(item: EvalItem) -> Prompt:
    """The rollout's prompt record: pixels loaded, reference first, the other answers as aliases."""
    return Prompt(
        id=item.key,
        question=item.question,
        images=[read_image_ref(r) for r in item.images],
        answer=item.answers[0],
        aliases=list(item.answers[1:]),
    )
