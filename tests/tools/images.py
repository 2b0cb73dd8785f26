"""Real test images made with OpenCV: rendered text and its degraded versions."""

from __future__ import annotations

import cv2
import numpy as np

FONT = cv2.FONT_HERSHEY_SIMPLEX


def text_image(
    lines: list[str], width: int = 640, line_height: int = 60, scale: float = 1.3, thickness: int = 3, margin: int = 30
) -> np.ndarray:
    """Black text on white, RGB uint8."""
    height = margin * 2 + line_height * len(lines)
    image = np.full((height, width, 3), 255, dtype=np.uint8)
    for i, line in enumerate(lines):
        cv2.putText(
            image,
            line,
            (margin, margin + line_height * i + int(line_height * 0.7)),
            FONT,
            scale,
            (0, 0, 0),
            thickness,
            cv2.LINE_AA,
        )
    return image


def scene(seed: int, size: tuple[int, int] = (160, 200)) -> np.ndarray:
    """A colourful synthetic 'photo' with shapes and a label; distinct per seed."""
    rng = np.random.default_rng(seed)
    height, width = size
    image = np.zeros((height, width, 3), dtype=np.uint8)
    image[:] = rng.integers(0, 255, size=3)
    for _ in range(8):
        colour = tuple(int(c) for c in rng.integers(0, 255, size=3))
        if rng.random() < 0.5:
            center = (int(rng.integers(0, width)), int(rng.integers(0, height)))
            cv2.circle(image, center, int(rng.integers(8, 40)), colour, -1)
        else:
            p1 = (int(rng.integers(0, width)), int(rng.integers(0, height)))
            p2 = (int(rng.integers(0, width)), int(rng.integers(0, height)))
            cv2.rectangle(image, p1, p2, colour, -1)
    cv2.putText(image, f"#{seed}", (10, height - 12), FONT, 0.9, (255, 255, 255), 2, cv2.LINE_AA)
    return image


def blur(image: np.ndarray, sigma: float = 2.0) -> np.ndarray:
    return cv2.GaussianBlur(image, (0, 0), sigma)


def downscale(image: np.ndarray, factor: int) -> np.ndarray:
    h, w = image.shape[:2]
    return cv2.resize(image, (w // factor, h // factor), interpolation=cv2.INTER_AREA)


def place_on_background(
    document: np.ndarray, corners: np.ndarray, size: tuple[int, int], background: int = 60
) -> np.ndarray:
    """Warp a document onto a dark canvas at the given corners (tl, tr, br, bl): a skewed photo."""
    h, w = document.shape[:2]
    source = np.array([[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]], dtype=np.float32)
    matrix = cv2.getPerspectiveTransform(source, corners.astype(np.float32))
    canvas = np.full((size[0], size[1], 3), background, dtype=np.uint8)
    return cv2.warpPerspective(document, matrix, (size[1], size[0]), dst=canvas, borderMode=cv2.BORDER_TRANSPARENT)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def sharpness(image: np.ndarray) -> float:
    """Variance of the Laplacian: higher means more high-frequency detail."""
    return float(cv2.Laplacian(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), cv2.CV_64F).var())
