"""OpenCV pictures of mini-world entities: a domain-specific figure plus a name plaque.

The figure's shape, colours and texture come from the entity's own seed, so reverse image search
(perceptual hash / ORB) tells entities apart; the plaque prints the title in large Hershey glyphs
so OCR can read it back.
"""

from __future__ import annotations

import hashlib
import math
import random

import cv2
import numpy as np

_FONT = cv2.FONT_HERSHEY_DUPLEX


def stable_seed(*parts: object) -> int:
    """A process-independent integer seed (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _colour(rng: random.Random) -> tuple[int, int, int]:
    return (rng.randrange(256), rng.randrange(256), rng.randrange(256))


def _figure(canvas: np.ndarray, domain: str, rng: random.Random) -> None:
    size = canvas.shape[0]
    cx, cy = size // 2 + rng.randrange(-size // 10, size // 10), int(size * 0.42)
    main, accent = _colour(rng), _colour(rng)
    scale = size / 512
    if domain == "Person":
        cv2.ellipse(canvas, (cx, cy + int(120 * scale)), (int(95 * scale), int(80 * scale)), 0, 180, 360, main, -1)
        cv2.circle(canvas, (cx, cy - int(10 * scale)), int(rng.randrange(45, 70) * scale), accent, -1)
    elif domain == "Building/Place":
        width, height = int(rng.randrange(120, 220) * scale), int(rng.randrange(150, 240) * scale)
        top = cy + int(140 * scale) - height
        cv2.rectangle(canvas, (cx - width // 2, top), (cx + width // 2, cy + int(140 * scale)), main, -1)
        roof = np.array(
            [[cx - width // 2 - 10, top], [cx + width // 2 + 10, top], [cx, top - int(rng.randrange(40, 110) * scale)]],
            np.int32,
        )
        cv2.fillPoly(canvas, [roof], accent)
        for _ in range(rng.randrange(3, 9)):
            x = rng.randrange(cx - width // 2 + 8, max(cx - width // 2 + 9, cx + width // 2 - 24))
            y = rng.randrange(top + 8, max(top + 9, cy + int(110 * scale)))
            cv2.rectangle(canvas, (x, y), (x + int(16 * scale), y + int(22 * scale)), accent, -1)
    elif domain == "Location":
        base = cy + int(140 * scale)
        x = int(40 * scale)
        while x < size - int(40 * scale):
            width = int(rng.randrange(25, 60) * scale)
            cv2.rectangle(
                canvas,
                (x, base - int(rng.randrange(60, 230) * scale)),
                (x + width, base),
                main if rng.random() < 0.5 else accent,
                -1,
            )
            x += width + int(rng.randrange(2, 12) * scale)
    elif domain == "Organism":
        axes = (int(rng.randrange(80, 150) * scale), int(rng.randrange(40, 80) * scale))
        cv2.ellipse(canvas, (cx, cy + int(40 * scale)), axes, rng.randrange(-30, 30), 0, 360, main, -1)
        for side in (-1, 1):
            wing = np.array(
                [
                    [cx, cy + int(30 * scale)],
                    [cx + side * int(170 * scale), cy - int(60 * scale)],
                    [cx + side * int(120 * scale), cy + int(60 * scale)],
                ],
                np.int32,
            )
            cv2.fillPoly(canvas, [wing], accent)
    else:  # Artifact
        sides = rng.randrange(3, 9)
        radius = int(rng.randrange(90, 150) * scale)
        angles = [2 * math.pi * k / sides + rng.random() * 0.3 for k in range(sides)]
        polygon = np.array(
            [[cx + radius * math.cos(a), cy + int(40 * scale) + radius * math.sin(a)] for a in angles], np.int32
        )
        cv2.fillPoly(canvas, [polygon], main)
        cv2.circle(canvas, (cx, cy + int(40 * scale)), radius // 3, accent, -1)


def _plaque(canvas: np.ndarray, title: str) -> None:
    """White plaque with the title in black, sized to the widest line that fits."""
    size = canvas.shape[0]
    words = title.split()
    cut = max(1, len(words) // 2)  # at most two lines, split near the middle
    lines = [" ".join(words[:cut]), " ".join(words[cut:])] if len(words) > 1 else [title]
    margin = size // 16
    scale = 1.5 * size / 512
    while scale > 0.4:
        widths = [cv2.getTextSize(line, _FONT, scale, 2)[0][0] for line in lines]
        if max(widths) <= size - 4 * margin:
            break
        scale -= 0.1
    thickness = max(1, round(scale * 1.5))
    line_height = cv2.getTextSize("Ag", _FONT, scale, thickness)[0][1] + int(14 * scale)
    top = size - margin - line_height * len(lines) - margin // 2
    cv2.rectangle(canvas, (margin, top), (size - margin, size - margin), (250, 250, 250), -1)
    cv2.rectangle(canvas, (margin, top), (size - margin, size - margin), (20, 20, 20), 3)
    y = top + margin // 4
    for line in lines:
        width = cv2.getTextSize(line, _FONT, scale, thickness)[0][0]
        y += line_height
        cv2.putText(
            canvas, line, ((size - width) // 2, y - int(6 * scale)), _FONT, scale, (10, 10, 10), thickness, cv2.LINE_AA
        )


def render_entity(title: str, domain: str, size: int, seed: int) -> np.ndarray:
    """An RGB uint8 ``(size, size, 3)`` picture of one entity; same arguments, same pixels."""
    if size < 64:
        raise ValueError(f"image size must be >= 64 pixels, got {size}")
    rng = random.Random(seed)
    top, bottom = np.array(_colour(rng), np.float32), np.array(_colour(rng), np.float32)
    ramp = np.linspace(0.0, 1.0, size, dtype=np.float32)[:, None, None]
    canvas = np.ascontiguousarray(
        np.broadcast_to(top * (1 - ramp) + bottom * ramp, (size, size, 3)).round().astype(np.uint8)
    )
    for _ in range(rng.randrange(6, 14)):  # texture: seeded dots make near-duplicates separable
        cv2.circle(
            canvas,
            (rng.randrange(size), rng.randrange(size // 2)),
            rng.randrange(3, max(4, size // 20)),
            _colour(rng),
            -1,
        )
    _figure(canvas, domain, rng)
    _plaque(canvas, title)
    return canvas
