"""Trainer-vs-engine logprob parity: rescore a finished trajectory with the training forward.

The trainer path is the packed forward over the rendered ids and pixels plus
``osvl_kernels.token_logprobs``; a drift from the engine's recorded logprobs means the two sides
do not run the same model on the same inputs (weights out of sync, image preprocessing, MRoPE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from osvl.data.chat import ChatRenderer
from osvl.data.image import pixel_values
from osvl.data.mrope import mrope_position_ids
from osvl.model.model import Qwen3VLModel
from osvl.rl.trajectory import Trajectory
from osvl_kernels import token_logprobs


@dataclass(frozen=True)
class ParityReport:
    mean_abs_diff: float
    max_abs_diff: float
    tokens: int


@torch.no_grad()
def trajectory_logprobs(
    model: Qwen3VLModel, renderer: ChatRenderer, traj: Trajectory, temperature: float = 1.0, backend: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """(trainer, engine) fp32 logprobs of the trajectory's policy tokens, in order."""
    seq = renderer.render_trajectory(traj)
    device = next(model.parameters()).device
    ids = torch.from_numpy(seq.input_ids).to(device)
    grids = [image.grid_thw for image in seq.images]
    positions = torch.from_numpy(
        mrope_position_ids(seq.input_ids, grids, renderer.tokenizer.special.image_pad, renderer.image_config.merge_size)
    ).to(device)
    pixels = grid = None
    if seq.images:
        pixels = torch.from_numpy(pixel_values(seq.images, renderer.image_config)).to(device)
        grid = torch.tensor(grids, device=device)
    cu = torch.tensor([0, len(ids)], dtype=torch.int32, device=device)
    logits = model(ids, cu_seqlens=cu, position_ids=positions, pixel_values=pixels, image_grid_thw=grid)
    if seq.loss_mask[0]:
        raise ValueError(f"trajectory {traj.prompt.id!r} starts with a policy token; nothing predicts it")
    policy = torch.from_numpy(seq.loss_mask[1:]).to(device)
    logp = token_logprobs(
        logits[:-1][policy].float().contiguous(), ids[1:][policy], temperature=temperature, backend=backend
    )
    return logp.cpu().numpy(), seq.logprobs[seq.loss_mask]


def logprob_parity(
    model: Qwen3VLModel,
    renderer: ChatRenderer,
    trajectories: Sequence[Trajectory],
    temperature: float = 1.0,
    backend: str = "auto",
) -> ParityReport:
    """Mean and max |trainer - engine| over every policy token of the batch."""
    diffs = [
        np.abs(a - b) for a, b in (trajectory_logprobs(model, renderer, t, temperature, backend) for t in trajectories)
    ]
    flat = np.concatenate(diffs) if diffs else np.zeros(0)
    if flat.size == 0:
        raise ValueError("no policy tokens to compare")
    return ParityReport(float(flat.mean()), float(flat.max()), int(flat.size))
