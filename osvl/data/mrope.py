"""3-D MRoPE position ids (temporal, height, width) for one Qwen3-VL sequence.

Text tokens advance all three axes together by one. An image block of merged grid (t, h, w)
starts at the current position p and takes t-, h- and w-positions p + [0, t), p + [0, h),
p + [0, w) in raster order; the text after it resumes at the block's maximum + 1. Packed
sequences each start again at 0 (the packer calls this once per sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_position_ids(
    input_ids: np.ndarray | Sequence[int],
    image_grid_thw: Sequence[Sequence[int]],
    image_token_id: int,
    merge_size: int = 2,
) -> np.ndarray:
    """[3, L] int64 positions; each image's pad run must hold exactly t*h*w / merge^2 tokens."""
    ids = np.asarray(input_ids)
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {ids.shape}")
    length = ids.shape[0]
    pads = np.flatnonzero(ids == image_token_id)
    positions = np.empty((3, length), dtype=np.int64)
    cursor = 0  # next token index to place
    position = 0  # next free position
    used = 0  # image pad tokens consumed so far
    for index, grid in enumerate(image_grid_thw):
        t, h, w = (int(v) for v in grid)
        if h % merge_size or w % merge_size or min(t, h, w) < 1:
            raise ValueError(f"image {index}: grid {tuple(grid)} is not a positive multiple of merge {merge_size}")
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        if used + count > pads.shape[0]:
            raise ValueError(f"image {index} needs {count} image tokens but only {pads.shape[0] - used} remain")
        start = int(pads[used])
        if pads[used + count - 1] != start + count - 1:
            raise ValueError(f"image {index}: its {count} image tokens at {start} are not contiguous")
        text = start - cursor
        positions[:, cursor:start] = position + np.arange(text)
        position += text
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[0, start : start + count] = position + tt.reshape(-1)
        positions[1, start : start + count] = position + hh.reshape(-1)
        positions[2, start : start + count] = position + ww.reshape(-1)
        position += max(t, gh, gw)
        cursor = start + count
        used += count
    if used != pads.shape[0]:
        raise ValueError(f"{pads.shape[0] - used} image tokens have no image_grid_thw entry")
    positions[:, cursor:] = position + np.arange(length - cursor)
    return positions
