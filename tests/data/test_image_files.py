"""Image files for SFT: grid from the header, pixels once per (file, config) and only on first use."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from osvl.data.image import DeferredImage, ImageConfig, image_grid, pixel_values, process_image, smart_resize
from osvl.data.image_files import ImageFile, ImageFileCache
from osvl.rl.trajectory import ImageStore

CONFIG = ImageConfig(patch_size=8, min_pixels=1024, max_pixels=16384)


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def stored(tmp_path, image: np.ndarray) -> ImageFile:
    sha = ImageStore(tmp_path).put(image)
    return ImageFile(tmp_path / f"{sha}.png", sha)


@pytest.mark.parametrize("size", [(40, 56), (3, 5), (300, 20), (128, 128), (700, 900)])
def test_image_grid_is_the_grid_process_image_makes(size):
    processed = process_image(noise(*size), CONFIG)
    assert image_grid(*size, CONFIG) == (processed.grid_thw, processed.num_tokens)
    height, width = smart_resize(*size, CONFIG)
    assert processed.pixels.shape == (height, width, 3)


def test_deferred_image_counts_tokens_from_the_header_and_decodes_on_first_use(tmp_path):
    image = noise(40, 90, seed=1)
    file = stored(tmp_path, image)
    cache = ImageFileCache()
    deferred = [cache.deferred(file, CONFIG) for _ in range(3)]  # one file named three times
    eager = process_image(image, CONFIG)
    assert (cache.num_files, cache.num_decoded) == (1, 0)  # headers only, so far
    assert all(
        (d.grid_thw, d.num_tokens, d.num_patches) == (eager.grid_thw, eager.num_tokens, eager.num_patches)
        for d in deferred
    )
    assert np.array_equal(pixel_values(deferred, CONFIG), pixel_values([eager] * 3, CONFIG))
    assert cache.num_decoded == 1  # decoded and resized once for all three uses
    assert deferred[0].pixels is deferred[2].pixels


def test_each_config_is_processed_on_its_own(tmp_path):
    image = noise(64, 48, seed=2)
    file = stored(tmp_path, image)
    cache, other = ImageFileCache(), ImageConfig(patch_size=8, min_pixels=4096, max_pixels=65536, resample="pil")
    small, large = cache.deferred(file, CONFIG), cache.deferred(file, other)
    assert np.array_equal(small.pixels, process_image(image, CONFIG).pixels)
    assert np.array_equal(large.pixels, process_image(image, other).pixels)
    assert small.grid_thw != large.grid_thw and (cache.num_files, cache.num_decoded) == (1, 2)


def test_unreadable_headers_fail_when_the_data_is_loaded(tmp_path):
    cache = ImageFileCache()
    with pytest.raises(ValueError, match=r"missing\.png: not a readable image"):
        cache.deferred(ImageFile(tmp_path / "missing.png"), CONFIG)
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"text\.png: not a readable image"):
        cache.deferred(ImageFile(tmp_path / "text.png"), CONFIG)
    buffer = io.BytesIO()
    Image.new("L", (12000, 9000)).save(buffer, format="PNG")  # a small file declaring 108 Mpx
    (tmp_path / "bomb.png").write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match=r"bomb\.png declares 12000x9000 = 108000000 pixels, over the limit"):
        cache.deferred(ImageFile(tmp_path / "bomb.png"), CONFIG)
    Image.fromarray(noise(2, 500)).save(tmp_path / "thin.png")
    with pytest.raises(ValueError, match=r"thin\.png: image aspect ratio 250\.0"):
        cache.deferred(ImageFile(tmp_path / "thin.png"), CONFIG)
    assert cache.num_decoded == 0


def test_bad_pixels_fail_when_first_packed_naming_the_file(tmp_path):
    file = stored(tmp_path, noise(40, 40, seed=3))
    cache = ImageFileCache()
    tampered = cache.deferred(file, CONFIG)
    Image.fromarray(noise(40, 40, seed=4)).save(file.path)  # same size, other pixels
    with pytest.raises(ValueError, match=f"{file.path.name} does not match its content hash"):
        pixel_values([tampered], CONFIG)
    truncated = stored(tmp_path, noise(48, 48, seed=5))
    deferred = cache.deferred(truncated, CONFIG)
    truncated.path.write_bytes(truncated.path.read_bytes()[:60])  # the header survives, the pixels do not
    with pytest.raises(ValueError, match=f"{truncated.path.name}: cannot decode image"):
        pixel_values([deferred], CONFIG)
    resized = stored(tmp_path, noise(40, 40, seed=6))
    deferred = cache.deferred(resized, CONFIG)
    Image.fromarray(noise(80, 40, seed=6)).save(resized.path)
    with pytest.raises(ValueError, match="decodes to 40x80 but its header declared 40x40"):
        pixel_values([deferred], CONFIG)
    assert cache.num_decoded == 0  # nothing bad was kept


def test_unchecked_files_decode_without_a_hash(tmp_path):
    image = noise(30, 50, seed=7)
    Image.fromarray(image).save(tmp_path / "plain.png")
    deferred = ImageFileCache().deferred(ImageFile(tmp_path / "plain.png"), CONFIG)
    assert np.array_equal(deferred.pixels, process_image(image, CONFIG).pixels)


def test_deferred_pixels_must_have_the_counted_grid():
    wrong = process_image(noise(64, 64), CONFIG)
    deferred = DeferredImage(grid_thw=(1, 4, 4), num_tokens=4, load=lambda: wrong)
    with pytest.raises(ValueError, match=r"grid \(1, 8, 8\), its tokens were counted for \(1, 4, 4\)"):
        pixel_values([deferred], CONFIG)


def test_pixels_beyond_the_byte_bound_are_evicted_least_recently_used_first(tmp_path):
    first, second = stored(tmp_path, noise(64, 64, seed=8)), stored(tmp_path, noise(64, 64, seed=9))
    one_image = process_image(noise(64, 64), CONFIG).pixels.nbytes
    cache = ImageFileCache(max_bytes=one_image)  # room for one processed image
    for file in (first, second, second, first):
        cache.processed(file, CONFIG)
    assert cache.num_decoded == 3  # second's repeat was held; first was evicted by second
    roomy = ImageFileCache(max_bytes=2 * one_image)
    for file in (first, second, second, first):
        assert np.array_equal(roomy.processed(file, CONFIG).pixels, cache.processed(file, CONFIG).pixels)
    assert roomy.num_decoded == 2
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        ImageFileCache(max_bytes=-1)
