"""Hand-written fixture files in the released formats (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

SYSTEM = "You are a careful search agent. Think, then call one tool or answer."
RELEASE_TOOLS_JSON = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "crop",
                "description": "Crop.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "image": {"type": "string"},
                        "x": {"type": "integer"},
                        "y": {"type": "integer"},
                        "width": {"type": "integer"},
                        "height": {"type": "integer"},
                    },
                    "required": ["image", "x", "y", "width", "height"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "text_search",
                "description": "Search.",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": []},
            },
        },
    ]
)


def rgb(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def write_png(path: Path, image: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))


def png_bytes(image: np.ndarray) -> bytes:
    ok, data = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    assert ok
    return data.tobytes()


def release_record(question_image: str, crop_image: str) -> dict:
    """A release-style trajectory: tool calls inside gpt turns, a tool image in an observation."""
    return {
        "conversations": [
            {"from": "human", "value": "<image>Which year did the bridge in the picture open?"},
            {
                "from": "gpt",
                "value": "<think>Zoom on the sign.</think>\n<tool_call>\n"
                '{"name": "crop", "arguments": {"image": "img_1", "x": 0, "y": 0, '
                '"width": 8, "height": 8}}\n</tool_call>',
            },
            {"from": "observation", "value": "<image>Image cropped successfully. New image ID: img_2."},
            {
                "from": "gpt",
                "value": "<think>The sign reads Kessock.</think>\n<tool_call>\n"
                '{"name": "text_search", "arguments": {"q": "Kessock Bridge opened"}}\n'
                "</tool_call>",
            },
            {"from": "observation", "value": "The Kessock Bridge opened in 1982."},
            {"from": "gpt", "value": "<think>It opened in 1982.</think>\n<response>1982</response>"},
        ],
        "images": [question_image, crop_image],
        "system": SYSTEM,
        "tools": RELEASE_TOOLS_JSON,
    }


def function_call_record() -> dict:
    """LLaMA-Factory's documented tool layout: separate function_call turns, no images."""
    return {
        "conversations": [
            {"from": "human", "value": "When did the Kessock Bridge open?"},
            {"from": "function_call", "value": json.dumps({"name": "text_search", "arguments": {"q": "Kessock"}})},
            {"from": "observation", "value": "Tool execution error:\nquota exceeded"},
            {"from": "function_call", "value": json.dumps({"name": "text_search", "arguments": {"q": "Kessock"}})},
            {"from": "observation", "value": "Opened 1982."},
            {"from": "gpt", "value": "<think>done</think>\n<response>1982</response>"},
        ],
        "system": SYSTEM,
        "tools": RELEASE_TOOLS_JSON,
    }
