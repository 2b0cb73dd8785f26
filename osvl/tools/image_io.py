"""Decoding untrusted image bytes without letting a small file become a huge allocation."""

from __future__ import annotations

import io
import os

import cv2
import numpy as np


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) read from the file header only, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as header:
            return header.size
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ValueError(f"not a readable image: {err}") from None


def decode_image(data: bytes, max_pixels: int) -> np.ndarray:
    """RGB uint8 pixels; files that would decode to more than ``max_pixels`` are refused."""
    width, height = image_size(data)
    if width * height > max_pixels:
        raise ValueError(f"image declares {width}x{height} = {width * height} pixels, over the limit of {max_pixels}")
    decoded = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if decoded is None:
        raise ValueError("image data could not be decoded")
    return cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB)


def read_image(path: str | os.PathLike[str], max_pixels: int) -> np.ndarray:
    with open(path, "rb") as handle:
        return decode_image(handle.read(), max_pixels)


def encode_png(image: np.ndarray) -> bytes:
    ok, png = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    if not ok:
        raise ValueError(f"PNG encoding failed for image of shape {image.shape}")
    return png.tobytes()
