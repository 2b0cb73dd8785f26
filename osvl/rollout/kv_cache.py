"""Incremental decoding for ``Qwen3VLModel`` with a KV cache, built from the model's own submodules.

The model's packed forward recomputes the whole context; generation needs each new token to
attend to cached keys and values instead. This module runs the same layers (norms, q/k/v
projections, QK-norm, interleaved MRoPE, output projection, FFN / MoE, DeepStack injection) on
a padded batch ``[B, L]`` of new tokens per row, appending to per-row caches of any length.
Its logits match the packed forward (tested), so engine and trainer score the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from osvl.model.model import Qwen3VLModel
from osvl.model.rope import mrope_table


@dataclass
class KVCache:
    """Per-layer keys/values ``[B, N_kv, capacity, H]`` and how many slots each row fills."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor  # [B] int64

    @classmethod
    def empty(cls, model: Qwen3VLModel, batch: int, capacity: int) -> KVCache:
        t = model.arch.text
        param = next(model.parameters())
        shape = (batch, t.num_key_value_heads, capacity, t.head_dim)

        def make():
            return [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(t.num_hidden_layers)]

        return cls(make(), make(), torch.zeros(batch, dtype=torch.long, device=param.device))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


def _attention_mask(lengths: torch.Tensor, new: torch.Tensor, steps: int, capacity: int) -> torch.Tensor:
    """[B, 1, L, C]: query i of row b sees slots < lengths[b] + min(i, new[b] - 1) + 1."""
    query = torch.arange(steps, device=lengths.device)
    last = lengths[:, None] + torch.minimum(query[None, :], (new[:, None] - 1).clamp(min=0))
    slots = torch.arange(capacity, device=lengths.device)
    return (slots[None, None, :] <= last[:, :, None]).unsqueeze(1)


@torch.no_grad()
def extend(
    model: Qwen3VLModel,
    cache: KVCache,
    input_ids: torch.Tensor,
    new_lengths: torch.Tensor,
    position_ids: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append ``input_ids [B, L]`` (row b's first ``new_lengths[b]`` are real) to the cache.

    ``position_ids [3, B, L]`` are MRoPE positions; images (all rows', in row order) fill the
    image-pad tokens of the real positions. Returns logits ``[B, L, V]`` (pad positions garbage).
    """
    a = model.arch
    B, L = input_ids.shape
    if position_ids.shape != (3, B, L):
        raise ValueError(f"position_ids must be [3, {B}, {L}], got {tuple(position_ids.shape)}")
    if int((cache.lengths + new_lengths).max()) > cache.capacity:
        raise ValueError(
            f"KV cache of {cache.capacity} slots cannot take {int((cache.lengths + new_lengths).max())} tokens"
        )
    real = torch.arange(L, device=input_ids.device)[None, :] < new_lengths[:, None]
    h = model.tok_embeddings(input_ids)
    deepstack: list[torch.Tensor] = []
    visual = None
    if pixel_values is not None:
        embeds, deepstack = model.visual(pixel_values, image_grid_thw)
        visual = real & (input_ids == a.image_token_id)
        if int(visual.sum()) != embeds.shape[0]:
            raise ValueError(f"{int(visual.sum())} image tokens but the images give {embeds.shape[0]} embeddings")
        h = h.clone()
        h[visual] = embeds.to(h.dtype)
    rope = mrope_table(
        position_ids.reshape(3, B * L), head_dim=a.text.head_dim, theta=a.text.rope_theta, sections=a.text.mrope_section
    ).view(B, L, -1)
    mask = _attention_mask(cache.lengths, new_lengths, L, cache.capacity)
    rows, positions = real.nonzero(as_tuple=True)  # every real token's row and place: one copy a layer
    slots = cache.lengths[rows] + positions
    for i, layer in enumerate(model.layers.values()):
        attn = layer.attention
        q, k, v = attn.qkv_linear(layer.attention_norm(h))
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rope(q, k, rope)
        keys, values = cache.keys[i], cache.values[i]
        keys[rows, :, slots] = k[rows, positions]
        values[rows, :, slots] = v[rows, positions]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=attn.enable_gqa
        )
        h = h + attn.wo(out.transpose(1, 2).flatten(2))
        h = h + (layer.moe(layer.ffn_norm(h)) if layer.moe_enabled else layer.feed_forward(layer.ffn_norm(h)))
        if i < len(deepstack):
            h = h.clone()
            h[visual] += deepstack[i].to(h.dtype)
    cache.lengths += new_lengths
    return model.lm_head(model.norm(h))
