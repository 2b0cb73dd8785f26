"""Hostile but well-formed inputs: every one gets a typed answer, never an exception or infra_error."""

import json
import struct
import zlib

import numpy as np
import pytest

from osvl.rl.trajectory import POLICY_ERRORS, ToolStatus
from osvl.tools import ImageSearchConfig, ToolBackendsConfig, VisualContext
from osvl.tools.catalog import default_registry
from osvl.tools.image_io import decode_image, encode_png
from osvl.tools.worker import run_job
from tests.tools.images import scene


def png_header_claiming(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR declaring ``width`` x ``height``, with one tiny IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def gif_header_claiming(width: int, height: int) -> bytes:
    screen = struct.pack("<HHBBB", width, height, 0, 0, 0)
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    return b"GIF89a" + screen + image + b"\x02\x02\x44\x01\x00\x3b"


BOMBS = {
    "png 100000x100000": png_header_claiming(100_000, 100_000),
    "gif 65535x65535": gif_header_claiming(65_535, 65_535),
    "png 6000x5000": png_header_claiming(6000, 5000),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_decompression_bombs_are_refused_from_the_header(name):
    with pytest.raises(ValueError, match="pixels"):
        decode_image(BOMBS[name], 24_000_000)


def test_image_bytes_are_bounded_before_decoding():
    png = encode_png(scene(1, (40, 50)))
    assert decode_image(png, 10_000, max_bytes=len(png)).shape == (40, 50, 3)
    with pytest.raises(ValueError, match=f"{len(png)} bytes, over the limit of {len(png) - 1}"):
        decode_image(png, 10_000, max_bytes=len(png) - 1)
    with pytest.raises(ValueError, match="not a readable image"):
        decode_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 40, 10_000)


DEGENERATE = [(1, 1), (1, 2000), (2000, 1), (4, 2000), (2000, 4), (2, 3)]


@pytest.fixture(scope="module")
def tools_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("collection")
    lines = []
    for seed in range(3):
        (folder / f"{seed}.png").write_bytes(encode_png(scene(seed, (120, 160))))
        lines.append(json.dumps({"image": f"{seed}.png", "title": f"Entity {seed}"}))
    (folder / "c.jsonl").write_text("\n".join(lines) + "\n")
    return ToolBackendsConfig(image_search=ImageSearchConfig(collection_path=str(folder / "c.jsonl")))


IMAGE_CALLS = {
    "image_search": {"image": 0},
    "crop": {"image": 0, "boxes": [[0, 0, 1, 1], [0, 0, 2000, 2000]]},
    "sharpen": {"image": 0},
    "super_resolution": {"image": 0, "scale": 2},
    "perspective_correct": {"image": 0},
    "ocr": {"image": 0},
}


@pytest.mark.parametrize("shape", DEGENERATE, ids=[f"{h}x{w}" for h, w in DEGENERATE])
@pytest.mark.parametrize("tool", sorted(IMAGE_CALLS))
def test_degenerate_images_get_an_answer_or_a_policy_error(tool, shape, tools_config):
    registry = default_registry()
    call = registry.parse({"name": tool, "arguments": IMAGE_CALLS[tool]})
    image = np.random.default_rng(shape[0] * 7 + shape[1]).integers(0, 255, (*shape, 3), dtype=np.uint8)
    status, text, images, error = run_job(registry.get(tool).target, call.arguments, [image], tools_config)
    assert status is ToolStatus.OK or status in POLICY_ERRORS, (status, error)
    if status is ToolStatus.OK:
        assert text or images


def test_visit_with_a_lone_surrogate_url_is_the_policys_error(fault_pool):
    from osvl.tools.environment import ToolEnvironment
    from osvl.tools.profiles import tool_profile

    env = ToolEnvironment(tool_profile("paper").registry, fault_pool)
    for raw in (
        '{"name": "visit", "arguments": {"url": "http://a/\\ud800"}}',
        {"name": "visit", "arguments": {"url": "\udfff", "goal": "x"}},
    ):
        result = env.execute_sync(raw, VisualContext())
        assert result.status is ToolStatus.INVALID_ARGUMENTS and "not valid Unicode" in result.error
        assert result.tool == "visit"
        json.dumps(result.error, ensure_ascii=False).encode("utf-8")  # the message itself is printable
