"""Small images and hand-written benchmark lines shared by the eval tests."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import cv2
import numpy as np


def rgb(height: int = 8, width: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def png_bytes(image: np.ndarray) -> bytes:
    ok, data = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    assert ok
    return data.tobytes()


def write_png(path: Path, image: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(image))
    return path


def b64(image: np.ndarray) -> str:
    return base64.b64encode(png_bytes(image)).decode()


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
