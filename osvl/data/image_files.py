"""Training images read from files: each file's header read once, its pixels decoded and resized once
per process and :class:`ImageConfig`, and only when a micro-batch that holds it is packed.

SFT data names the same image in many trajectories (the demo: 534 files in 3,366 places), and each
data-parallel rank packs only its share of every step. Token counts, which every rank needs for the
packing plan, follow from an image's size alone (:func:`osvl.data.image.image_grid`), which the header
gives. A file whose header cannot be read (missing, not an image, too many pixels, too elongated)
fails when the data is loaded; one whose pixels cannot be decoded, or do not match their content
hash, fails when it is first packed, naming the file.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from osvl.data.image import (
    MAX_DECODE_PIXELS,
    DeferredImage,
    ImageConfig,
    ProcessedImage,
    decode_image,
    image_grid,
    process_image,
)
from osvl.image_header import check_declared_pixels, image_size
from osvl.rl.trajectory import image_sha256


@dataclass(frozen=True)
class ImageFile:
    """An image on disk; ``sha256`` is the content hash its decoded pixels must have ("" = unchecked)."""

    path: Path
    sha256: str = ""


class ImageFileCache:
    """Headers and processed pixels of image files, each made once while it fits.

    Headers are kept for every file (a few bytes each); processed pixels are kept most recently
    used first under ``max_bytes`` (per process), so a share larger than the bound is decoded again
    rather than held in memory.
    """

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._sizes: dict[Path, tuple[int, int]] = {}
        self._processed: OrderedDict[tuple[ImageFile, ImageConfig], ProcessedImage] = OrderedDict()
        self._held_bytes = 0
        self.num_decoded = 0  # (file, config) decodes and resizes so far, again after an eviction

    @property
    def num_files(self) -> int:
        """Distinct files whose header was read."""
        return len(self._sizes)

    def deferred(self, file: ImageFile, config: ImageConfig) -> DeferredImage:
        """The file as a processed image: its grid from the header now, its pixels on first use."""
        height, width = self.size(file)
        try:
            grid, num_tokens = image_grid(height, width, config)
        except ValueError as error:
            raise ValueError(f"image {file.path}: {error}") from None
        return DeferredImage(grid, num_tokens, functools.partial(self.processed, file, config))

    def size(self, file: ImageFile) -> tuple[int, int]:
        """(height, width) the file's header declares, bounded as :func:`decode_image` bounds it."""
        if file.path not in self._sizes:
            try:
                width, height = image_size(file.path)
            except ValueError as error:
                raise ValueError(f"image {file.path}: {error}") from None
            check_declared_pixels(width, height, MAX_DECODE_PIXELS, what=f"image {file.path}")
            self._sizes[file.path] = (height, width)
        return self._sizes[file.path]

    def processed(self, file: ImageFile, config: ImageConfig) -> ProcessedImage:
        """The file decoded, checked against its hash and resized under ``config``; made once while it fits."""
        key = (file, config)
        if key in self._processed:
            self._processed.move_to_end(key)
            return self._processed[key]
        processed = process_image(self._decode(file), config)
        self.num_decoded += 1
        self._processed[key] = processed
        self._held_bytes += processed.pixels.nbytes
        while self._held_bytes > self.max_bytes:
            _, evicted = self._processed.popitem(last=False)
            self._held_bytes -= evicted.pixels.nbytes
        return processed

    def _decode(self, file: ImageFile) -> np.ndarray:
        try:
            pixels = decode_image(file.path.read_bytes())
        except (OSError, ValueError) as error:
            raise ValueError(f"image {file.path}: {error}") from None
        height, width = self.size(file)
        if pixels.shape[:2] != (height, width):
            raise ValueError(
                f"image {file.path} decodes to {pixels.shape[1]}x{pixels.shape[0]} but its header "
                f"declared {width}x{height} (changed on disk?)"
            )
        if file.sha256 and image_sha256(pixels) != file.sha256:
            raise ValueError(f"image {file.path} does not match its content hash {file.sha256}")
        return pixels
