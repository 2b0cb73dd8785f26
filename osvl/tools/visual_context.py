"""The trajectory's active visual context: ``I_0`` plus every image a tool has produced.

The model refers to images only by their index here, never by path or URL, so a tool call can
reach nothing outside the rollout. The context only grows (the paper keeps every historical
visual observation), up to ``ToolLimits.max_context_images``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from osvl.rl.trajectory import check_image
from osvl.tools.errors import ToolError
from osvl.tools.limits import ToolLimits


class VisualContext:
    def __init__(self, images: Iterable[np.ndarray] = (), limits: ToolLimits | None = None) -> None:
        self.limits = limits or ToolLimits()
        self._images: list[np.ndarray] = []
        for image in images:
            self.append(image)

    def __len__(self) -> int:
        return len(self._images)

    @property
    def images(self) -> list[np.ndarray]:
        return list(self._images)

    def append(self, image: np.ndarray) -> int:
        """Add an image and return its index; oversized images are refused, not shrunk."""
        check_image(image)
        pixels = image.shape[0] * image.shape[1]
        if pixels > self.limits.max_image_pixels:
            raise ValueError(
                f"image of {image.shape[1]}x{image.shape[0]} = {pixels} pixels exceeds "
                f"the limit of {self.limits.max_image_pixels}"
            )
        if len(self._images) >= self.limits.max_context_images:
            raise ValueError(
                f"the visual context already holds {len(self._images)} images (limit {self.limits.max_context_images})"
            )
        self._images.append(np.ascontiguousarray(image))
        return len(self._images) - 1

    def resolve(self, index: int) -> np.ndarray:
        """The image a model-supplied index points to; a bad index is the model's mistake."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise ToolError(f"image must be an integer index, got {index!r}")
        if not 0 <= index < len(self._images):
            if not self._images:
                raise ToolError("there is no image in the context to refer to")
            raise ToolError(f"image index {index} does not exist; valid indices are 0..{len(self._images) - 1}")
        return self._images[index]
