"""Qwen3-VL vision tower: 16px x 2-frame patches, interpolated learned position grid, axial
2-D rotary, bidirectional attention per frame, 2x2 spatial merge, DeepStack taps.

Patches arrive flattened as ``(C, t, p, p)`` rows in merge-block order (the HF image
processor's layout), so the Conv3d patch embedding is one Linear over those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.embedding import Embedding
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.nn_modules import LayerNorm
from torchtitan.protocols.module import Module, ModuleDict, ModuleList

from osvl.model.attention import AttentionBackend, packed_attention, packed_metadata
from osvl.model.config import VisionConfig
from osvl.model.rope import apply_rotary, vision_rope_table


def validate_grid(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, config: VisionConfig
) -> list[tuple[int, int, int]]:
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3 or grid_thw.is_floating_point():
        raise ValueError(
            f"image_grid_thw must be an integer [N, 3] tensor, got {tuple(grid_thw.shape)} {grid_thw.dtype}"
        )
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    m = config.spatial_merge_size
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ValueError(f"grid (t={t}, h={h}, w={w}) must be positive with h, w divisible by {m}")
    total = sum(t * h * w for t, h, w in grids)
    if pixel_values.ndim != 2 or pixel_values.shape != (total, config.patch_dim):
        raise ValueError(
            f"pixel_values must be [{total}, {config.patch_dim}] for grids {grids}, got {tuple(pixel_values.shape)}"
        )
    return grids


def merge_block_positions(h: int, w: int, merge: int, device=None) -> torch.Tensor:
    """``[h*w, 2]`` (row, col) of each patch in merge-block order."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    order = (0, 2, 1, 3)
    return torch.stack([rows.permute(order).flatten(), cols.permute(order).flatten()], dim=-1)


def interpolate_position_grid(table: torch.Tensor, h: int, w: int, merge: int) -> torch.Tensor:
    """Bilinearly resample the square learned grid ``[side*side, D]`` to ``[h*w, D]`` (merge-block order)."""
    side = int(round(table.shape[0] ** 0.5))
    grid = table.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()
    out = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
    out = out.view(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
    return out.reshape(h * w, -1).to(table.dtype)


class VisionMLP(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden_dim: int

    def __init__(self, config: Config):
        super().__init__()
        self.linear_fc1 = Linear.Config(in_features=config.dim, out_features=config.hidden_dim, bias=True).build()
        self.linear_fc2 = Linear.Config(in_features=config.hidden_dim, out_features=config.dim, bias=True).build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionAttention(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_heads: int
        backend: AttentionBackend = "sdpa"

    def __init__(self, config: Config):
        super().__init__()
        self.n_heads = config.n_heads
        self.backend = config.backend
        self.qkv = Linear.Config(in_features=config.dim, out_features=3 * config.dim, bias=True).build()
        self.proj = Linear.Config(in_features=config.dim, out_features=config.dim, bias=True).build()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, meta) -> torch.Tensor:
        P = x.shape[0]
        q, k, v = self.qkv(x).view(P, 3, self.n_heads, -1).unbind(1)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = packed_attention(q, k, v, meta, causal=False, scale=None, backend=self.backend)
        return self.proj(out.reshape(P, -1))


class VisionBlock(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        hidden_dim: int
        n_heads: int
        eps: float
        backend: AttentionBackend = "sdpa"

    def __init__(self, config: Config):
        super().__init__()
        self.norm1 = LayerNorm.Config(normalized_shape=config.dim, eps=config.eps).build()
        self.norm2 = LayerNorm.Config(normalized_shape=config.dim, eps=config.eps).build()
        self.attn = VisionAttention.Config(dim=config.dim, n_heads=config.n_heads, backend=config.backend).build()
        self.mlp = VisionMLP.Config(dim=config.dim, hidden_dim=config.hidden_dim).build()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, meta) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, meta)
        return x + self.mlp(self.norm2(x))


class PatchMerger(Module):
    """Concatenates each 2x2 block of patches and projects to the decoder width."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        merge: int
        out_dim: int
        eps: float
        norm_after_shuffle: bool

    def __init__(self, config: Config):
        super().__init__()
        merged = config.dim * config.merge**2
        self.merged = merged
        self.norm_after_shuffle = config.norm_after_shuffle
        norm_dim = merged if config.norm_after_shuffle else config.dim
        self.norm = LayerNorm.Config(normalized_shape=norm_dim, eps=config.eps).build()
        self.linear_fc1 = Linear.Config(in_features=merged, out_features=merged, bias=True).build()
        self.linear_fc2 = Linear.Config(in_features=merged, out_features=config.out_dim, bias=True).build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.norm_after_shuffle else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        vision: VisionConfig
        backend: AttentionBackend = "sdpa"

    def __init__(self, config: Config):
        super().__init__()
        v = config.vision
        v.validate()
        self.vision = v
        self.patch_embed = ModuleDict(
            {"proj": Linear.Config(in_features=v.patch_dim, out_features=v.hidden_size, bias=True).build()}
        )
        self.pos_embed = Embedding.Config(num_embeddings=v.num_position_embeddings, embedding_dim=v.hidden_size).build()
        block = VisionBlock.Config(
            dim=v.hidden_size,
            hidden_dim=v.intermediate_size,
            n_heads=v.num_heads,
            eps=v.layer_norm_eps,
            backend=config.backend,
        )
        self.blocks = ModuleList([block.build() for _ in range(v.depth)])
        merger = dict(dim=v.hidden_size, merge=v.spatial_merge_size, out_dim=v.out_hidden_size, eps=v.layer_norm_eps)
        self.merger = PatchMerger.Config(**merger, norm_after_shuffle=False).build()
        self.deepstack_merger_list = ModuleList(
            [PatchMerger.Config(**merger, norm_after_shuffle=True).build() for _ in v.deepstack_visual_indexes]
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns merged image embeddings ``[P/4, D_text]`` and one DeepStack feature per tap."""
        v = self.vision
        grids = validate_grid(pixel_values, grid_thw, v)
        proj = self.patch_embed["proj"]
        x = proj(pixel_values.to(proj.weight.dtype))
        m, dev = v.spatial_merge_size, x.device
        pos, hw, frame_lens = [], [], []
        for t, h, w in grids:
            pos.append(interpolate_position_grid(self.pos_embed.weight, h, w, m).repeat(t, 1))
            hw.append(merge_block_positions(h, w, m, dev).repeat(t, 1))
            frame_lens += [h * w] * t
        x = x + torch.cat(pos).to(x.dtype)
        rope = vision_rope_table(torch.cat(hw), head_dim=v.head_dim, theta=v.rope_theta)
        cu = torch.tensor([0] + frame_lens, device=dev).cumsum(0).to(torch.int32)
        meta = packed_metadata(cu, x.shape[0])
        deepstack = []
        taps = list(v.deepstack_visual_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, meta)
            if i in taps:
                deepstack.append(self.deepstack_merger_list[taps.index(i)](x))
        return self.merger(x), deepstack
