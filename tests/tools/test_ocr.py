import json

import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import OcrConfig, ToolBackendsConfig
from osvl.tools.image_tools import perspective_correct
from osvl.tools.ocr import (
    LayoutRegion,
    OcrBlock,
    OcrLine,
    format_blocks,
    group_blocks,
    local_ocr,
    reading_order,
    render_observation,
)
from osvl.tools.worker import run_job
from tests.tools.images import blur, place_on_background, text_image

CDLA_LABELS = {
    "text",
    "title",
    "figure",
    "figure_caption",
    "table",
    "table_caption",
    "header",
    "footer",
    "reference",
    "equation",
}
LINES = ["QUARTERLY REPORT", "Revenue rose 12 percent", "Net margin 7.5 percent"]


def test_reading_order_rows_then_columns():
    boxes = [(300, 10, 400, 30), (10, 12, 100, 32), (10, 50, 100, 70), (300, 200, 400, 220), (10, 200, 100, 222)]
    assert reading_order(boxes) == [1, 0, 2, 4, 3]


def test_group_blocks_attaches_lines_to_regions():
    lines = [
        OcrLine("Body two", 0.9, (10, 60, 200, 80)),
        OcrLine("Heading", 0.9, (10, 5, 120, 30)),
        OcrLine("Body one", 0.9, (10, 35, 200, 55)),
        OcrLine("stray", 0.9, (400, 300, 450, 320)),
    ]
    regions = [LayoutRegion("text", 0.8, (0, 33, 220, 90)), LayoutRegion("title", 0.9, (0, 0, 150, 32))]
    blocks = group_blocks(lines, regions)
    assert [(b.block_label, b.block_content) for b in blocks] == [
        ("title", "Heading"),
        ("text", "Body one\nBody two"),
        ("text", "stray"),
    ]
    assert blocks[1].block_bbox == [0, 33, 220, 90]
    assert format_blocks(blocks) == "# Heading\n\nBody one\nBody two\n\nstray"
    parsed = json.loads(render_observation(blocks))
    assert parsed["formatted_text"].startswith("# Heading") and parsed["blocks"][0]["block_label"] == "title"
    assert group_blocks([], regions) == []


def test_local_ocr_reads_rendered_text_back_as_layout_blocks():
    document = text_image(LINES, width=560, scale=1.0, thickness=2)
    status, text, images, error = run_job(
        "osvl.tools.ocr:ocr_tool",
        {"image": 0, "chart_recognition": False, "doc_orientation": False},
        [document],
        ToolBackendsConfig(),
    )
    assert status is ToolStatus.OK, error
    observation = json.loads(text)
    contents = [block["block_content"] for block in observation["blocks"]]
    assert contents == LINES
    assert {block["block_label"] for block in observation["blocks"]} <= CDLA_LABELS
    for line in LINES:
        assert line in observation["formatted_text"]
    assert images == []


def test_perspective_correct_restores_a_warped_document_for_ocr():
    document = text_image(LINES, width=560, scale=1.0, thickness=2)
    corners = np.array([[150, 20], [560, 140], [540, 300], [20, 330]], dtype=np.float32)
    photo = blur(place_on_background(document, corners, (360, 600)), 0.8)
    fixed = perspective_correct(photo)
    assert fixed.corners is not None
    blocks = local_ocr(fixed.image, OcrConfig())
    assert [b.block_content for b in blocks] == LINES  # one block per line, in reading order


def test_ocr_on_a_blank_image_is_ok_and_empty():
    blocks = local_ocr(np.full((64, 64, 3), 255, np.uint8), OcrConfig())
    assert blocks == [] and json.loads(render_observation(blocks)) == {"blocks": [], "formatted_text": ""}


def test_ocr_config_validation():
    with pytest.raises(ValueError, match="needs paddlex_url"):
        OcrConfig(backend="paddlex")
    with pytest.raises(ValueError, match="backend must be one of"):
        OcrConfig(backend="tesseract")
    assert isinstance(OcrBlock("text", "x", [0, 0, 1, 1]).block_bbox, list)
