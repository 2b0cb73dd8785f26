"""Token ids a policy must never generate: the vision placeholders that only the renderer places.

A generated ``<|image_pad|>`` has no pixels behind it. The next turn's MRoPE positions, SGLang's
image-token expansion and the trainer's packing all match pad runs against images and fail on
it; a stray ``<|vision_start|>``/``<|vision_end|>`` breaks the pad-run framing SGLang's Qwen-VL
processor looks for. Ids the tokenizer cannot decode (a model's padded vocabulary rows) are just
as unusable. The local engine masks all of them out of sampling; the agent loop checks every
generation anyway, because a remote engine may not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from osvl.data.tokenizer import Tokenizer

VISION_PLACEHOLDERS = ("vision_start", "vision_end", "image_pad", "video_pad")
VISION_PAD = "<|vision_pad|>"  # in Qwen's added tokens, though not in SpecialTokens


def reserved_vision_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Sorted ids of the vision placeholders this tokenizer has."""
    ids = {getattr(tokenizer.special, name) for name in VISION_PLACEHOLDERS}
    vision_pad = tokenizer.backend.token_to_id(VISION_PAD)
    if vision_pad is not None:
        ids.add(vision_pad)
    return tuple(sorted(ids))


@dataclass(frozen=True)
class UnusableToken:
    position: int  # index in the generation
    token_id: int


def find_unusable(token_ids: Sequence[int], reserved: Sequence[int], vocab_size: int) -> list[UnusableToken]:
    """Every generated id that is a reserved placeholder or outside ``[0, vocab_size)``."""
    banned = set(reserved)
    return [
        UnusableToken(i, int(t)) for i, t in enumerate(token_ids) if int(t) in banned or not 0 <= int(t) < vocab_size
    ]
