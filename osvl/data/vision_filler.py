"""The vision filler: a one-token blank image document (no loss) appended to a micro-batch without images.

Under FSDP every rank must run the vision tower in every forward, or the ranks' all-gathers fall out
of step; the filler is its own document, so it attends to nothing real.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from osvl.data.chat import ChatRenderer
from osvl.data.image import ImageConfig
from osvl.data.mrope import mrope_position_ids
from osvl.data.packing import PackedBatch
from osvl.data.tokenizer import SpecialTokens


def with_vision_filler(batch: PackedBatch, image_config: ImageConfig, special: SpecialTokens) -> PackedBatch:
    """``batch`` with the filler document when it holds no image (else ``batch`` itself)."""
    if batch.image_grid_thw.shape[0] > 0:
        return batch
    m = image_config.merge_size
    ids = np.array([special.vision_start, special.image_pad, special.vision_end], dtype=np.int64)
    grid = [1, m, m]
    positions = torch.from_numpy(mrope_position_ids(ids, [grid], special.image_pad, m))
    patch_dim = 3 * image_config.temporal_patch_size * image_config.patch_size**2
    n = len(ids)
    zeros_long = torch.zeros(n, dtype=torch.int64)
    return dataclasses.replace(
        batch,
        input_ids=torch.cat([batch.input_ids, torch.from_numpy(ids)]),
        target_ids=torch.cat([batch.target_ids, zeros_long]),
        cu_seqlens=torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:] + n]),
        position_ids=torch.cat([batch.position_ids, positions], dim=1),
        pixel_values=torch.zeros(m * m, patch_dim, dtype=torch.float32),
        image_grid_thw=torch.tensor([grid], dtype=torch.int64),
        loss_mask=torch.cat([batch.loss_mask, torch.zeros(n, dtype=torch.bool)]),
        token_step=torch.cat([batch.token_step, zeros_long]),
        old_logprobs=torch.cat([batch.old_logprobs, torch.zeros(n)]),
    )


def with_grpo_filler(batch: PackedBatch, renderer: ChatRenderer) -> PackedBatch:
    """``with_vision_filler`` for a GRPO micro-batch: the filler document also gets its per-sequence
    loss inputs (no group, not fatal, reward and advantage 0)."""
    filled = with_vision_filler(batch, renderer.image_config, renderer.tokenizer.special)
    extra = filled.cu_seqlens.shape[0] - 1 - filled.fatal_step.shape[0]
    if extra == 0:
        return filled
    pad_long, pad_float = torch.full((extra,), -1, dtype=torch.int64), torch.zeros(extra)
    return dataclasses.replace(
        filled,
        group_ids=torch.cat([filled.group_ids, pad_long]),
        fatal_step=torch.cat([filled.fatal_step, pad_long]),
        rewards=torch.cat([filled.rewards, pad_float]),
        advantages=None if filled.advantages is None else torch.cat([filled.advantages, pad_float]),
    )
