"""Decoding untrusted image bytes without letting a small file become a huge allocation.

Bytes are bounded first, then the header's declared size (read by PIL without decoding pixels),
and only then does OpenCV decode. Every refusal is a ``ValueError`` naming the limit. OpenCV is
imported where pixels are coded, so a text-only tool stack runs without it (a GPU image may lack it).
"""

from __future__ import annotations

import os

import numpy as np

from osvl.image_header import check_declared_pixels, image_size


def decode_image(data: bytes, max_pixels: int, max_bytes: int | None = None) -> np.ndarray:
    """RGB uint8 pixels; more than ``max_bytes`` of data, or a header declaring more than ``max_pixels``,
    is refused before anything is decoded."""
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"image data is {len(data)} bytes, over the limit of {max_bytes}")
    check_declared_pixels(*image_size(data), max_pixels)
    import cv2

    decoded = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if decoded is None or decoded.size == 0:
        raise ValueError("image data could not be decoded")
    return cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB)


def read_image(path: str | os.PathLike[str], max_pixels: int, max_bytes: int | None = None) -> np.ndarray:
    if max_bytes is not None and os.path.getsize(path) > max_bytes:
        raise ValueError(f"{path} is {os.path.getsize(path)} bytes, over the limit of {max_bytes}")
    with open(path, "rb") as handle:
        return decode_image(handle.read(), max_pixels, max_bytes)


def encode_png(image: np.ndarray) -> bytes:
    import cv2

    ok, png = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    if not ok:
        raise ValueError(f"PNG encoding failed for image of shape {image.shape}")
    return png.tobytes()
