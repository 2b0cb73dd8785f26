"""Padded [B, L] <-> packed [T] conversion for trainers that hand us rectangular batches.

Packing keeps only the positions a mask selects, row by row, so the fused losses never spend work
on padding. Row b becomes packed sequence b (a row with nothing selected is an empty sequence:
it still counts as a sequence, as the padded trainers count it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed token came from in the padded [B, L] batch."""

    index: torch.Tensor  # [T] int64: flat position b * L + l of each packed token
    cu_seqlens: torch.Tensor  # [B+1] int32: one packed sequence per padded row
    batch_size: int
    seq_len: int


def pack_layout(mask: torch.Tensor) -> PackedLayout:
    """Layout that keeps the positions where `mask` [B, L] is true, in row-major order."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a 2-D [B, L] tensor, got {shape}")
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"mask must be a bool or integer 0/1 tensor, got {mask.dtype}")
    keep = mask.bool()
    batch_size, seq_len = keep.shape
    cu_seqlens = torch.zeros(batch_size + 1, dtype=torch.int32, device=mask.device)
    cu_seqlens[1:] = keep.sum(dim=1).cumsum(0)
    index = keep.reshape(-1).nonzero().squeeze(1)
    return PackedLayout(index=index, cu_seqlens=cu_seqlens, batch_size=batch_size, seq_len=seq_len)


def pack(padded: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """[B, L, *] -> [T, *]; differentiable (the gradient scatters back to the kept positions)."""
    if padded.dim() < 2 or tuple(padded.shape[:2]) != (layout.batch_size, layout.seq_len):
        raise ValueError(f"expected a [{layout.batch_size}, {layout.seq_len}, ...] tensor, got {tuple(padded.shape)}")
    return padded.reshape(layout.batch_size * layout.seq_len, *padded.shape[2:]).index_select(0, layout.index)


def unpack(packed: torch.Tensor, layout: PackedLayout, fill: float = 0.0) -> torch.Tensor:
    """[T, *] -> [B, L, *] with `fill` at the positions that were not kept."""
    if packed.shape[0] != layout.index.numel():
        raise ValueError(f"expected {layout.index.numel()} packed rows, got {packed.shape[0]}")
    flat = packed.new_full((layout.batch_size * layout.seq_len, *packed.shape[1:]), fill)
    flat[layout.index] = packed
    return flat.reshape(layout.batch_size, layout.seq_len, *packed.shape[1:])
