"""Rotary tables for Qwen3-VL: interleaved 3-D MRoPE (text) and axial 2-D RoPE (vision).

Tables are computed once per forward in fp32 as ``cat(cos, sin)`` rows and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.protocols.module import Module


def inverse_frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def mrope_axis_of_frequency(head_dim: int, sections: tuple[int, int, int], device=None) -> torch.Tensor:
    """Which position axis (0=t, 1=h, 2=w) drives each of the head_dim/2 frequencies.

    Interleaved layout: frequency i uses h when i % 3 == 1 and i < 3*sections[1], w when
    i % 3 == 2 and i < 3*sections[2], and t otherwise.
    """
    n = head_dim // 2
    idx = torch.arange(n, device=device)
    axis = torch.zeros(n, dtype=torch.long, device=device)
    axis[(idx % 3 == 1) & (idx < 3 * sections[1])] = 1
    axis[(idx % 3 == 2) & (idx < 3 * sections[2])] = 2
    return axis


def mrope_table(
    position_ids: torch.Tensor, *, head_dim: int, theta: float, sections: tuple[int, int, int]
) -> torch.Tensor:
    """``[T, 2*head_dim]`` fp32 ``cat(cos, sin)`` for 3-D positions ``[3, T]``."""
    inv = inverse_frequencies(head_dim, theta, position_ids.device)
    freqs = position_ids[..., None].float() * inv  # [3, T, head_dim/2]
    axis = mrope_axis_of_frequency(head_dim, sections, position_ids.device)
    freqs = freqs.gather(0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.cat([emb.cos(), emb.sin()], dim=-1)


def vision_rope_table(hw_positions: torch.Tensor, *, head_dim: int, theta: float) -> torch.Tensor:
    """``[P, 2*head_dim]`` fp32 table for per-patch (row, col) positions ``[P, 2]``."""
    inv = inverse_frequencies(head_dim // 2, theta, hw_positions.device)
    freqs = (hw_positions[..., None].float() * inv).flatten(1)  # [P, head_dim/2]: h freqs then w freqs
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.cat([emb.cos(), emb.sin()], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., T, N, H]`` by ``table [T, 2H]`` in fp32; returns x's dtype."""
    head_dim = x.shape[-1]
    cos = table[..., :head_dim].unsqueeze(-2)
    sin = table[..., head_dim:].unsqueeze(-2)
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).type_as(x)


class PrecomputedRoPE(Module):
    """Drop-in for torchtitan's ``RoPE`` inside ``GQAttention``: the ``positions`` argument it
    receives is the model-level rotary table, so the 3-D MRoPE gather happens once per forward."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            raise ValueError("PrecomputedRoPE needs the rotary table passed as `positions`")
        table = positions
        if isinstance(query, DTensor) and not isinstance(table, DTensor):
            table = DTensor.from_local(
                table, query.device_mesh, [Replicate()] * query.device_mesh.ndim, run_check=False
            )
        return apply_rotary(query, table), apply_rotary(key, table)
