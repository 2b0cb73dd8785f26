"""An image's declared size, read from its header before any pixel is decoded: the check that stops
a small file from becoming a huge allocation (a decompression bomb). Torch-free, so tool workers and
the data layer share it without the other's imports."""

from __future__ import annotations

import io
import os
import warnings


def image_size(source: bytes | os.PathLike[str]) -> tuple[int, int]:
    """(width, height) read from the header only, of encoded bytes or of a file (read no further than
    its header); ValueError when it is not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the caller applies its own bound
            with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as header:
                return header.size
    except Image.DecompressionBombError as err:  # PIL refuses over twice its own limit before telling the size
        raise ValueError(f"image declares too many pixels: {err}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as err:
        raise ValueError(f"not a readable image: {err}") from None


def check_declared_pixels(width: int, height: int, max_pixels: int, what: str = "image") -> None:
    """Refuses a header that declares more than ``max_pixels``, before anything is decoded."""
    if width * height > max_pixels:
        raise ValueError(f"{what} declares {width}x{height} = {width * height} pixels, over the limit of {max_pixels}")
