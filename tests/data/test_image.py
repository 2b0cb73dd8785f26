"""Qwen3-VL image preprocessing: parity with transformers' processor, limits, bad input."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from osvl.data.image import (
    ImageConfig,
    decode_image,
    pixel_values,
    process_image,
    resize_bicubic,
    smart_resize,
)

QWEN3_VL_PREPROCESSOR = {  # preprocessor_config.json of the released Qwen3-VL checkpoints
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# A small pixel budget keeps the parity cases fast while exercising both resize branches.
SMALL = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 48}
SIZES = [(64, 128), (50, 70), (300, 200), (3, 5), (1, 1), (1000, 30), (30, 1000), (96, 96), (700, 900)]


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def smooth(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([127 + 100 * np.sin(x / 17), 127 + 100 * np.cos(y / 23), 127 + 100 * np.sin((x + y) / 29)], axis=-1)
    return img.clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = dict(
        QWEN3_VL_PREPROCESSOR, size={"shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]}
    )
    config.pop("processor_class")
    config.pop("image_processor_type")
    return Qwen2VLImageProcessorPil(**config)


def test_default_config_is_qwen3_vl():
    assert ImageConfig.from_preprocessor_config(QWEN3_VL_PREPROCESSOR) == ImageConfig()
    config = ImageConfig()
    assert (config.factor, config.patch_dim) == (32, 1536)


@pytest.mark.parametrize("size", SIZES)
def test_pil_resampler_is_bit_exact_with_transformers(hf_processor, size):
    image = noise(*size, seed=size[0] * 7 + size[1])
    ours = process_image(image, ImageConfig(**SMALL, resample="pil"))
    theirs = hf_processor(images=[image], return_tensors="np", input_data_format="channels_last")
    assert list(theirs["image_grid_thw"][0]) == list(ours.grid_thw)
    values = pixel_values([ours], ImageConfig(**SMALL))
    assert values.dtype == np.float32 and values.shape == theirs["pixel_values"].shape
    np.testing.assert_allclose(values, theirs["pixel_values"], rtol=0, atol=1e-6)


def test_multi_image_batch_matches_transformers(hf_processor):
    images = [noise(64, 128, 1), smooth(333, 100), noise(40, 40, 2)]
    config = ImageConfig(**SMALL, resample="pil")
    ours = [process_image(image, config) for image in images]
    theirs = hf_processor(images=images, return_tensors="np", input_data_format="channels_last")
    assert theirs["image_grid_thw"].tolist() == [list(p.grid_thw) for p in ours]
    np.testing.assert_allclose(pixel_values(ours, config), theirs["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(50, 70), (300, 200), (1000, 30)])
def test_torch_resampler_agrees_with_pil_within_a_level(hf_processor, size):
    image = smooth(*size)
    config = ImageConfig(**SMALL)
    ours = pixel_values([process_image(image, config)], config)
    theirs = hf_processor(images=[image], return_tensors="np", input_data_format="channels_last")["pixel_values"]
    level = 2 / 255  # one uint8 step after (x/255 - 0.5) / 0.5
    diff = np.abs(ours - theirs)
    assert diff.mean() < 0.25 * level and diff.max() <= 3 * level + 1e-6


def test_no_resize_when_already_aligned_is_exact(hf_processor):
    image = noise(96, 160, 3)  # multiple of 32, within budget: both paths skip the resampler
    config = ImageConfig(**SMALL)
    processed = process_image(image, config)
    assert processed.pixels is image or np.array_equal(processed.pixels, image)
    theirs = hf_processor(images=[image], return_tensors="np", input_data_format="channels_last")["pixel_values"]
    np.testing.assert_allclose(pixel_values([processed], config), theirs, rtol=0, atol=1e-6)


def test_smart_resize_matches_transformers_on_a_grid_of_sizes():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    config = ImageConfig()
    for h in (1, 15, 16, 17, 100, 255, 512, 1080, 4097, 20000):
        for w in (1, 33, 200, 640, 1920, 5000, 30000):
            if max(h, w) / min(h, w) > 200:
                continue
            ours = smart_resize(h, w, config)
            assert ours == hf_resize(h, w, factor=32, min_pixels=config.min_pixels, max_pixels=config.max_pixels)
            assert ours[0] % 32 == 0 and ours[1] % 32 == 0
            assert config.min_pixels <= ours[0] * ours[1] <= config.max_pixels


def test_token_count_and_patch_layout():
    config = ImageConfig(**SMALL)
    processed = process_image(noise(96, 160), config)
    assert processed.grid_thw == (1, 6, 10)
    assert processed.num_tokens == 1 * 6 * 10 // 4 == 15
    values = pixel_values([processed], config)
    assert values.shape == (processed.num_patches, 1536)
    # Row 1 is the second patch of the first 2x2 merge window: patch (row 0, col 1), frame 0 and 1.
    patch = processed.pixels[0:16, 16:32].astype(np.float32) / 255 * 2 - 1  # (16, 16, 3)
    row = values[1].reshape(3, 2, 16, 16)
    np.testing.assert_allclose(row[:, 0], patch.transpose(2, 0, 1), atol=1e-6)
    np.testing.assert_array_equal(row[:, 0], row[:, 1])
    # Row 2 starts the second row of that window: patch (row 1, col 0).
    below = processed.pixels[16:32, 0:16].astype(np.float32) / 255 * 2 - 1
    np.testing.assert_allclose(values[2].reshape(3, 2, 16, 16)[:, 0], below.transpose(2, 0, 1), atol=1e-6)


def test_huge_image_is_downscaled_into_the_budget():
    config = ImageConfig(min_pixels=32 * 32, max_pixels=32 * 32 * 16)
    processed = process_image(np.full((3000, 2000, 3), 200, dtype=np.uint8), config)
    h, w = processed.pixels.shape[:2]
    assert h * w <= config.max_pixels and h % 32 == 0 and w % 32 == 0
    assert (processed.pixels == 200).all()


def test_empty_batch_has_no_rows():
    assert pixel_values([], ImageConfig()).shape == (0, 1536)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.zeros((0, 10, 3), np.uint8), "H, W > 0"),
        (np.zeros((10, 10), np.uint8), "shape"),
        (np.zeros((10, 10, 4), np.uint8), "shape"),
        (np.zeros((10, 10, 3), np.float32), "uint8"),
        ("not an image", "numpy uint8"),
    ],
)
def test_bad_images_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        process_image(bad, ImageConfig())


def test_extreme_aspect_ratio_raises():
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(np.zeros((2, 500, 3), np.uint8), ImageConfig())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_pixels": 100}, "min_pixels"),
        ({"min_pixels": 4096, "max_pixels": 2048}, "max_pixels"),
        ({"patch_size": 0}, "patch_size"),
        ({"image_std": (0.5, 0.0, 0.5)}, "std"),
        ({"resample": "lanczos"}, "resample"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageConfig(**kwargs)


def test_resize_rejects_unknown_resampler():
    with pytest.raises(ValueError, match="resample"):
        resize_bicubic(noise(10, 10), 32, 32, resample="area")


def test_decode_image_converts_to_rgb_and_rejects_garbage():
    rgb = noise(20, 30, 4)
    ok, png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok and np.array_equal(decode_image(png.tobytes()), rgb)
    ok, gray_png = cv2.imencode(".png", rgb[:, :, 0])
    gray = decode_image(gray_png.tobytes())
    assert gray.shape == (20, 30, 3) and np.array_equal(gray[:, :, 1], rgb[:, :, 0])
    ok, rgba_png = cv2.imencode(".png", np.dstack([cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), rgb[:, :, :1]]))
    assert np.array_equal(decode_image(rgba_png.tobytes()), rgb)
    with pytest.raises(ValueError, match="corrupt"):
        decode_image(b"\x89PNG\r\n\x1a\nthis is not a png")
    with pytest.raises(ValueError, match="non-empty"):
        decode_image(b"")


def test_exported_preprocessor_config_drives_transformers_like_training():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    exported = ImageConfig().to_preprocessor_config()
    assert {k: exported[k] for k in QWEN3_VL_PREPROCESSOR} == QWEN3_VL_PREPROCESSOR
    small = ImageConfig(**SMALL, resample="pil")
    written = small.to_preprocessor_config()
    assert ImageConfig.from_preprocessor_config(written) == ImageConfig(**SMALL)
    kwargs = {k: v for k, v in written.items() if k not in ("processor_class", "image_processor_type")}
    image = noise(300, 200, seed=5)
    theirs = Qwen2VLImageProcessorPil(**kwargs)(images=[image], return_tensors="np", input_data_format="channels_last")
    ours = process_image(image, small)
    assert list(theirs["image_grid_thw"][0]) == list(ours.grid_thw)
    np.testing.assert_allclose(pixel_values([ours], small), theirs["pixel_values"], rtol=0, atol=1e-6)


def test_decode_image_refuses_a_decompression_bomb_before_decoding():
    import io

    from PIL import Image

    from osvl.data.formats.records import Rejected, decode_image_bytes

    buffer = io.BytesIO()
    Image.new("L", (3000, 3000)).save(buffer, format="PNG")  # a few KB declaring 9 Mpx
    bomb = buffer.getvalue()
    assert len(bomb) < 100_000
    with pytest.raises(ValueError, match="3000x3000 = 9000000 pixels, over the limit of 1000000"):
        decode_image(bomb, max_pixels=1_000_000)
    assert decode_image(bomb).shape == (3000, 3000, 3)  # under the default bound
    with pytest.raises(Rejected, match="cannot be decoded"):
        decode_image_bytes(b"not an image", "row 3")
