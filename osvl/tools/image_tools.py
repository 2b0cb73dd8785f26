"""Local image operators: crop, unsharp-mask sharpen, perspective rectification.

Pure functions on ``uint8`` RGB arrays, plus the thin ``*_tool`` entry points the worker calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from osvl.tools.config import ToolBackendsConfig
from osvl.tools.errors import ToolError
from osvl.tools.registry import ToolOutput

MIN_CROP_SIDE = 4  # pixels; smaller regions carry nothing a model can read


def crop_box_pixels(
    box: Sequence[float], width: int, height: int, coordinates: str = "pixel"
) -> tuple[int, int, int, int]:
    """Convert one model box to integer pixel bounds, explaining any problem in model terms."""
    if len(box) != 4:
        raise ToolError(f"a box needs 4 numbers [x1, y1, x2, y2], got {len(box)}")
    if not all(np.isfinite(v) for v in box):
        raise ToolError(f"box {list(box)} contains a non-finite number")
    if coordinates == "normalized_1000":
        if any(v < 0 or v > 1000 for v in box):
            raise ToolError(f"box {list(box)} is outside the 0-1000 normalized range")
        x1, y1, x2, y2 = (box[0] * width / 1000, box[1] * height / 1000, box[2] * width / 1000, box[3] * height / 1000)
    elif coordinates == "pixel":
        x1, y1, x2, y2 = box
        if min(x1, y1) < 0 or x2 > width or y2 > height:
            raise ToolError(
                f"box {list(box)} exceeds the image of width {width} and height {height}; "
                f"use 0 <= x1 < x2 <= {width} and 0 <= y1 < y2 <= {height}"
            )
    else:
        raise ToolError(f"coordinates must be 'pixel' or 'normalized_1000', got {coordinates!r}")
    if x2 <= x1 or y2 <= y1:
        raise ToolError(f"box {list(box)} is empty or inverted; need x1 < x2 and y1 < y2")
    left, top = int(np.floor(x1)), int(np.floor(y1))
    right, bottom = min(int(np.ceil(x2)), width), min(int(np.ceil(y2)), height)
    if right - left < MIN_CROP_SIDE or bottom - top < MIN_CROP_SIDE:
        raise ToolError(
            f"box {list(box)} is {right - left}x{bottom - top} pixels; "
            f"each side must be at least {MIN_CROP_SIDE} pixels"
        )
    return left, top, right, bottom


def crop(image: np.ndarray, boxes: Sequence[Sequence[float]], coordinates: str = "pixel") -> list[np.ndarray]:
    height, width = image.shape[:2]
    regions = [crop_box_pixels(box, width, height, coordinates) for box in boxes]
    return [np.ascontiguousarray(image[top:bottom, left:right]) for left, top, right, bottom in regions]


def sharpen(image: np.ndarray, amount: float = 1.0, sigma: float = 1.0) -> np.ndarray:
    """Unsharp mask ``(1 + a) I - a G_sigma * I``, computed in float32 and rounded back to uint8."""
    source = image.astype(np.float32)
    blurred = cv2.GaussianBlur(source, (0, 0), sigmaX=sigma, sigmaY=sigma, borderType=cv2.BORDER_REFLECT)
    return cv2.addWeighted(source, 1.0 + amount, blurred, -amount, 0.0, dtype=cv2.CV_8U)  # rounds and saturates


@dataclass
class Rectification:
    image: np.ndarray
    corners: np.ndarray | None  # 4x2 float32 (tl, tr, br, bl) in the input, None when none was found
    note: str


def order_corners(points: np.ndarray) -> np.ndarray:
    """Sort four points as top-left, top-right, bottom-right, bottom-left."""
    points = points.reshape(4, 2).astype(np.float32)
    sums, diffs = points.sum(axis=1), np.diff(points, axis=1).ravel()
    return np.array(
        [points[np.argmin(sums)], points[np.argmin(diffs)], points[np.argmax(sums)], points[np.argmax(diffs)]],
        dtype=np.float32,
    )


def find_document_quad(image: np.ndarray, min_area_fraction: float = 0.2) -> np.ndarray | None:
    """Largest convex quadrilateral outline (Canny edges -> contours -> polygon fit)."""
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    gray = cv2.GaussianBlur(gray, (5, 5), 0)
    edges = cv2.Canny(gray, 50, 150)
    edges = cv2.dilate(edges, np.ones((3, 3), np.uint8))
    contours, _ = cv2.findContours(edges, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    min_area = min_area_fraction * image.shape[0] * image.shape[1]
    for contour in sorted(contours, key=cv2.contourArea, reverse=True):
        if cv2.contourArea(contour) < min_area:
            break
        perimeter = cv2.arcLength(contour, True)
        for epsilon in (0.02, 0.04):
            polygon = cv2.approxPolyDP(contour, epsilon * perimeter, True)
            if len(polygon) == 4 and cv2.isContourConvex(polygon):
                return order_corners(polygon)
    return None


def perspective_correct(image: np.ndarray) -> Rectification:
    corners = find_document_quad(image)
    if corners is None:
        return Rectification(
            image, None, "no document outline (four-sided contour) was found; the image is returned unchanged"
        )
    tl, tr, br, bl = corners
    width = int(round(max(np.linalg.norm(tr - tl), np.linalg.norm(br - bl))))
    height = int(round(max(np.linalg.norm(bl - tl), np.linalg.norm(br - tr))))
    target = np.array([[0, 0], [width - 1, 0], [width - 1, height - 1], [0, height - 1]], dtype=np.float32)
    matrix = cv2.getPerspectiveTransform(corners, target)
    warped = cv2.warpPerspective(image, matrix, (width, height), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)
    return Rectification(warped, corners, f"rectified the document outline to {width}x{height}")


def crop_tool(arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig) -> ToolOutput:
    crops = crop(images[0], arguments["boxes"], arguments["coordinates"])
    sizes = ", ".join(f"{c.shape[1]}x{c.shape[0]}" for c in crops)
    return ToolOutput(text=f"cropped {len(crops)} region(s): {sizes}", images=crops)


def sharpen_tool(arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig) -> ToolOutput:
    out = sharpen(images[0], arguments["amount"], arguments["sigma"])
    return ToolOutput(text=f"sharpened with amount={arguments['amount']:g} sigma={arguments['sigma']:g}", images=[out])


def perspective_correct_tool(
    arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig
) -> ToolOutput:
    result = perspective_correct(images[0])
    return ToolOutput(text=result.note, images=[result.image])
