"""The image processor a HF checkpoint directory ships (``preprocessor_config.json``).

Released Qwen3-VL checkpoints fix the pixel budget and patching their vision tower was trained
with; reading it from the directory keeps a continued run on the same image tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from osvl.data.image import ImageConfig

PREPROCESSOR_FILE = "preprocessor_config.json"


def checkpoint_image_config(directory: str | os.PathLike[str]) -> ImageConfig | None:
    """The directory's image settings; ``None`` when it ships no ``preprocessor_config.json``."""
    file = Path(directory) / PREPROCESSOR_FILE
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}")  # noqa: TRY004 (bad input is a ValueError throughout osvl)
    try:
        return ImageConfig.from_preprocessor_config(raw)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{file}: {error}") from None
