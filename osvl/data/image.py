"""Qwen3-VL image preprocessing: smart resize, normalisation, patch flattening.

The arithmetic is Qwen2-VL's processor as Qwen3-VL configures it (patch 16, temporal patch 2,
2x2 merge, mean = std = 0.5). Two resamplers, both bicubic with antialiasing:

- ``"torch"`` (default): float32 interpolation, then clamp and round to uint8. This is what
  transformers' torchvision ("fast") processor computes, i.e. what SGLang / vLLM feed the model.
- ``"pil"``: Pillow's fixed-point resampler, bit-exact with transformers' PIL processor.

They differ by a few uint8 levels where bicubic overshoots (PIL clips between its two passes).

A processed image keeps its resized uint8 pixels (8x smaller than the float32 patches with their
duplicated temporal frame); :func:`pixel_values` expands them only when a micro-batch is packed.
An image's pad-token count follows from its size alone (:func:`image_grid`), so a
:class:`DeferredImage` can stand in for it, with the pixels made only when a micro-batch needs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from osvl.image_header import check_declared_pixels, image_size
from osvl.rl.trajectory import check_image

MAX_ASPECT_RATIO = 200  # Qwen's smart_resize refuses anything more elongated
RESAMPLERS = ("torch", "pil")


@dataclass(frozen=True)
class ImageConfig:
    """Qwen3-VL's preprocessor_config.json (``size.shortest_edge`` / ``size.longest_edge`` are pixels)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # 256 x 256
    max_pixels: int = 16777216  # 4096 x 4096
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: str = "torch"  # "torch" (fast processor / engines) or "pil" (slow processor)

    def __post_init__(self) -> None:
        if self.resample not in RESAMPLERS:
            raise ValueError(f"resample must be one of {RESAMPLERS}, got {self.resample!r}")
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_pixels < self.factor**2:
            raise ValueError(
                f"min_pixels={self.min_pixels} must be >= factor^2 = {self.factor**2} "
                f"(one merged patch); smaller budgets can resize an image to nothing"
            )
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels={self.max_pixels} must be >= min_pixels={self.min_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("image_mean and image_std need 3 channels, std > 0")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged patch (32 px for Qwen3-VL)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Width of one pixel_values row: C * temporal_patch * patch * patch (1536)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_preprocessor_config(cls, config: dict) -> ImageConfig:
        """Reads the HF ``preprocessor_config.json`` dict (``size`` or legacy min/max_pixels)."""
        size = config.get("size") or {}
        return cls(
            patch_size=int(config.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(config.get("merge_size", cls.merge_size)),
            min_pixels=int(size.get("shortest_edge", config.get("min_pixels", cls.min_pixels))),
            max_pixels=int(size.get("longest_edge", config.get("max_pixels", cls.max_pixels))),
            image_mean=tuple(config.get("image_mean", cls.image_mean)),
            image_std=tuple(config.get("image_std", cls.image_std)),
        )

    def to_preprocessor_config(self) -> dict:
        """The HF ``preprocessor_config.json`` dict an exported checkpoint ships, so transformers,
        SGLang and :meth:`from_preprocessor_config` patch images exactly as training did."""
        return {
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
        }

    def to_video_preprocessor_config(self) -> dict:
        """The ``video_preprocessor_config.json`` dict: transformers' ``AutoProcessor`` (so SGLang and
        vLLM) needs one to build the Qwen3-VL processor. osvl trains on no video; the patching is the
        vision tower's, the frame sampling and per-video token budget Qwen3-VL's (128 to 768 merged
        patches), rescaled to this patch grid."""
        return {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "processor_class": "Qwen3VLProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "size": {"shortest_edge": 128 * self.factor**2, "longest_edge": 768 * self.factor**2},
            "do_sample_frames": True,
            "fps": 2,
            "min_frames": 4,
            "max_frames": 768,
        }


@dataclass(frozen=True)
class ProcessedImage:
    """A resized uint8 image and its patch grid; ``num_tokens`` image pads stand for it in text."""

    pixels: np.ndarray  # (H', W', 3) uint8, H' and W' multiples of config.factor
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches before the merge
    num_tokens: int  # t * h * w / merge^2

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True, eq=False)
class DeferredImage:
    """A processed image whose grid is known (from the file's header) and whose pixels are made on
    first use, when a micro-batch that holds it is packed; ``load`` may cache them."""

    grid_thw: tuple[int, int, int]
    num_tokens: int
    load: Callable[[], ProcessedImage]

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def pixels(self) -> np.ndarray:
        processed = self.load()
        if processed.grid_thw != self.grid_thw:
            raise ValueError(
                f"deferred image: the pixels came out as grid {processed.grid_thw}, "
                f"its tokens were counted for {self.grid_thw}"
            )
        return processed.pixels


def smart_resize(height: int, width: int, config: ImageConfig) -> tuple[int, int]:
    """Target (H', W'): multiples of ``factor``, pixel count within [min, max], aspect kept."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image must have positive size, got {height}x{width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {ratio:.1f} ({height}x{width}) exceeds {MAX_ASPECT_RATIO}; "
            f"crop or pad it before processing"
        )
    factor = config.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt(height * width / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_bicubic(image: np.ndarray, height: int, width: int, resample: str = "torch") -> np.ndarray:
    """Antialiased bicubic resize of a uint8 RGB image, rounded back to uint8."""
    if resample not in RESAMPLERS:
        raise ValueError(f"resample must be one of {RESAMPLERS}, got {resample!r}")
    if image.shape[:2] == (height, width):
        return image
    if resample == "pil":
        from PIL import Image

        return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.BICUBIC))
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
    y = F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return y[0].clamp_(0, 255).round_().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()


def image_grid(height: int, width: int, config: ImageConfig) -> tuple[tuple[int, int, int], int]:
    """``(grid_thw, num_tokens)`` of an image of that size: what its pad tokens follow from, pixels unseen."""
    resized_height, resized_width = smart_resize(height, width, config)
    grid = (1, resized_height // config.patch_size, resized_width // config.patch_size)
    return grid, grid[0] * grid[1] * grid[2] // config.merge_size**2


def process_image(image: np.ndarray, config: ImageConfig) -> ProcessedImage:
    """Validates and resizes one RGB uint8 image; its token count follows from the grid."""
    check_image(image)
    grid, num_tokens = image_grid(image.shape[0], image.shape[1], config)
    pixels = resize_bicubic(image, grid[1] * config.patch_size, grid[2] * config.patch_size, config.resample)
    return ProcessedImage(pixels=pixels, grid_thw=grid, num_tokens=num_tokens)


def pixel_values(images: list[ProcessedImage | DeferredImage], config: ImageConfig) -> np.ndarray:
    """Normalised patches of all images, concatenated: [sum(t*h*w), C*temporal*patch*patch] float32.

    Row order inside an image is merge-window major: (h/m, w/m, m, m), so the m*m rows the vision
    merger fuses into one LLM token are adjacent. A still image fills both temporal slots.
    """
    if not images:
        return np.zeros((0, config.patch_dim), dtype=np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    rows = []
    for image in images:
        chw = image.pixels.transpose(2, 0, 1).astype(np.float32) * np.float32(1 / 255)
        chw = (chw - mean) / std
        _, gh, gw = image.grid_thw
        x = chw.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
        rows.append(x.reshape(gh * gw, config.patch_dim))
    return np.concatenate(rows, axis=0)


MAX_DECODE_PIXELS = 100_000_000  # what any image may declare before it is decoded (a decompression bomb)


def decode_image(data: bytes, max_pixels: int = MAX_DECODE_PIXELS) -> np.ndarray:
    """Encoded bytes (PNG, JPEG, WebP, ...) -> RGB uint8; gray is replicated and alpha dropped. A
    header declaring more than ``max_pixels`` is refused before anything is decoded."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
        raise ValueError("image data must be non-empty bytes")
    try:
        width, height = image_size(bytes(data))
    except ValueError as error:
        raise ValueError(f"cannot decode image ({len(data)} bytes): corrupt or unsupported format ({error})") from None
    check_declared_pixels(width, height, max_pixels)
    import cv2  # decoding only: packing and the model run without OpenCV (GPU images may lack it)

    decoded = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
    if decoded is None or decoded.size == 0:
        raise ValueError(f"cannot decode image ({len(data)} bytes): corrupt or unsupported format")
    if decoded.dtype != np.uint8:
        raise ValueError(f"only 8-bit images are supported, got {decoded.dtype}")
    if decoded.ndim == 2:
        return cv2.cvtColor(decoded, cv2.COLOR_GRAY2RGB)
    conversions = {3: cv2.COLOR_BGR2RGB, 4: cv2.COLOR_BGRA2RGB}
    if decoded.shape[2] not in conversions:
        raise ValueError(f"unsupported channel count {decoded.shape[2]}")
    return cv2.cvtColor(decoded, conversions[decoded.shape[2]])
