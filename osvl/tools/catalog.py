"""The seven tools of the paper (Table 1, Appendix F) as specs: schema, implementation, deadline.

Coordinates for ``crop`` are pixels of the referenced image by default (``x1, y1, x2, y2`` with
``0 <= x1 < x2 <= width``); ``coordinates="normalized_1000"`` reads them on a 0-1000 grid over
the image instead (Qwen-VL grounding convention).
"""

from __future__ import annotations

from typing import Any

from osvl.tools.limits import ToolLimits
from osvl.tools.registry import ToolRegistry, ToolSpec

_IMAGE = {
    "type": "integer",
    "minimum": 0,
    "description": "Index of an image in the visual context: 0 is the question image, "
    "images returned by tools follow in the order they were produced.",
}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


def builtin_specs(limits: ToolLimits) -> list[ToolSpec]:
    query = {"type": "string", "minLength": 1, "maxLength": limits.max_text_chars, "description": "Search query."}
    top_k = {
        "type": "integer",
        "minimum": 1,
        "maximum": limits.max_top_k,
        "default": min(5, limits.max_top_k),
        "description": "Number of results.",
    }
    box = {
        "type": "array",
        "minItems": 4,
        "maxItems": 4,
        "items": {"type": "number"},
        "description": "[x1, y1, x2, y2], top-left and bottom-right corners.",
    }
    return [
        ToolSpec(
            name="text_search",
            description="Search the web for a text query; returns passages (title, url, a short "
            "query-focused summary of the page).",
            parameters=_object({"query": query, "top_k": top_k}, ["query"]),
            target="osvl.tools.text_search:text_search_tool",
            deadline_s=60.0,
            cacheable=True,
        ),
        ToolSpec(
            name="image_search",
            description="Reverse image search: find web pages and entities that show the given image; "
            "returns titles, captions and page ids of visual matches.",
            parameters=_object({"image": _IMAGE, "top_k": top_k}, ["image"]),
            target="osvl.tools.image_search:image_search_tool",
            image_args=("image",),
            deadline_s=30.0,
            cacheable=True,
        ),
        ToolSpec(
            name="sharpen",
            description="Unsharp-mask an image, (1 + amount) * I - amount * Gaussian(I); use on blurry images. "
            "Returns a new image.",
            parameters=_object(
                {
                    "image": _IMAGE,
                    "amount": {
                        "type": "number",
                        "minimum": 0.0,
                        "maximum": 5.0,
                        "default": 1.0,
                        "description": "Sharpening strength.",
                    },
                    "sigma": {
                        "type": "number",
                        "minimum": 0.3,
                        "maximum": 10.0,
                        "default": 1.0,
                        "description": "Gaussian blur radius in pixels.",
                    },
                },
                ["image"],
            ),
            target="osvl.tools.image_tools:sharpen_tool",
            image_args=("image",),
            deadline_s=10.0,
        ),
        ToolSpec(
            name="super_resolution",
            description="Upscale a low-resolution image with a super-resolution network. Returns a new image.",
            parameters=_object(
                {
                    "image": _IMAGE,
                    "scale": {"type": "integer", "enum": [2, 4], "default": 2, "description": "Upscaling factor."},
                },
                ["image"],
            ),
            target="osvl.tools.superres:super_resolution_tool",
            image_args=("image",),
            deadline_s=60.0,
        ),
        ToolSpec(
            name="perspective_correct",
            description="Rectify a skewed photo of a document or screen to a fronto-parallel view. "
            "If no document outline is found the image is returned unchanged with a note.",
            parameters=_object({"image": _IMAGE}, ["image"]),
            target="osvl.tools.image_tools:perspective_correct_tool",
            image_args=("image",),
            deadline_s=15.0,
        ),
        ToolSpec(
            name="crop",
            description="Cut rectangular regions out of an image; each box becomes a new image. "
            "Boxes must lie inside the image.",
            parameters=_object(
                {
                    "image": _IMAGE,
                    "boxes": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": limits.max_crops,
                        "items": box,
                        "description": f"Up to {limits.max_crops} boxes.",
                    },
                    "coordinates": {
                        "type": "string",
                        "enum": ["pixel", "normalized_1000"],
                        "default": "pixel",
                        "description": "'pixel': image pixels; 'normalized_1000': 0-1000 relative to width and height.",
                    },
                },
                ["image", "boxes"],
            ),
            target="osvl.tools.image_tools:crop_tool",
            image_args=("image",),
            deadline_s=10.0,
        ),
        ToolSpec(
            name="ocr",
            description="Read the text of an image as layout blocks (title, text, table, caption, ...) "
            "in reading order.",
            parameters=_object(
                {
                    "image": _IMAGE,
                    "chart_recognition": {
                        "type": "boolean",
                        "default": False,
                        "description": "Also parse charts (online backend).",
                    },
                    "doc_orientation": {
                        "type": "boolean",
                        "default": False,
                        "description": "Detect and undo page rotation first.",
                    },
                },
                ["image"],
            ),
            target="osvl.tools.ocr:ocr_tool",
            image_args=("image",),
            deadline_s=60.0,
        ),
    ]


def default_registry(limits: ToolLimits | None = None) -> ToolRegistry:
    limits = limits or ToolLimits()
    return ToolRegistry(builtin_specs(limits), limits)


def tool_schemas(limits: ToolLimits | None = None) -> list[dict[str, Any]]:
    """The built-in tools in OpenAI function style, exactly as the prompt renders them."""
    return default_registry(limits).tool_schemas()
