"""The tool server's wire format, which ``osvl.tools.server`` and its clients (``osvl.tools.client``)
both speak: a ``ToolResult`` as JSON, images as base64 PNG, and the header that names the server process.

Protocol (JSON): ``GET /v1/tools`` -> the OpenAI tool schemas; ``GET /v1/stats`` -> pool counters;
``POST /v1/call`` with ``{"tool", "arguments", "images": [base64 PNG], "deadline_s", "end_to_end_s"?}``
-> ``{"status", "tool", "text", "images", "error", "elapsed_s", "queue_s", "run_s", "worker"}``. Tool
outcomes, including the policy's bad arguments, are HTTP 200 with a typed ``status``; protocol mistakes
are 4xx and overload 503, each with a JSON ``{"error", "kind"}`` body.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools.image_io import decode_image, encode_png

INSTANCE_HEADER = "X-Tool-Server-Instance"  # on every answer: a new value after the server restarted


def encode_images(images: list[Any]) -> list[str]:
    return [base64.b64encode(encode_png(image)).decode("ascii") for image in images]


def decode_images(encoded: Any, max_pixels: int, max_bytes: int | None = None) -> list[Any]:
    if not isinstance(encoded, list) or not all(isinstance(item, str) for item in encoded):
        raise ValueError("'images' must be a list of base64 PNG strings")
    try:
        return [decode_image(base64.b64decode(item, validate=True), max_pixels, max_bytes) for item in encoded]
    except binascii.Error as err:
        raise ValueError(f"an image is not valid base64: {err}") from None


def result_to_json(result: ToolResult) -> dict[str, Any]:
    return {
        "status": result.status.value,
        "tool": result.tool,
        "text": result.text,
        "images": encode_images(result.images),
        "error": result.error,
        "elapsed_s": result.elapsed_s,
        "queue_s": result.queue_s,
        "run_s": result.run_s,
        "worker": result.worker,
    }


def result_from_json(payload: dict[str, Any], max_pixels: int, max_bytes: int | None = None) -> ToolResult:
    return ToolResult(
        status=ToolStatus.parse(payload["status"]),
        tool=str(payload["tool"]),
        text=str(payload["text"]),
        images=decode_images(payload["images"], max_pixels, max_bytes),
        error=payload.get("error"),
        elapsed_s=float(payload.get("elapsed_s", 0.0)),
        queue_s=float(payload.get("queue_s", 0.0)),
        run_s=float(payload.get("run_s", 0.0)),
        worker=str(payload.get("worker", "")),
    )


def dumps(payload: Any) -> bytes:
    # ASCII escapes keep any lone surrogate in an echoed value valid JSON; NaN cannot occur in our payloads
    return json.dumps(payload, ensure_ascii=True).encode("ascii")
