"""Hard limits against hostile or runaway tool arguments, enforced before any work is done."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolLimits:
    max_image_pixels: int = 24_000_000  # any image in or out of a tool (decompression bombs, x4 SR)
    max_image_bytes: int = 32 << 20  # encoded bytes of one image handed to a tool or the tool server
    max_crops: int = 8  # boxes in one crop call
    max_text_chars: int = 2_000  # any string argument (queries)
    max_call_chars: int = 32_000  # the raw JSON of one call
    max_top_k: int = 10  # results per search
    max_context_images: int = 64  # images the active visual context may hold
    max_observation_chars: int = 16_000  # observation text beyond this is truncated, with a note

    def __post_init__(self) -> None:
        for name in (
            "max_image_pixels",
            "max_image_bytes",
            "max_crops",
            "max_text_chars",
            "max_call_chars",
            "max_top_k",
            "max_context_images",
            "max_observation_chars",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ToolLimits.{name} must be a positive integer, got {value!r}")
