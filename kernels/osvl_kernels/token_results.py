"""What a token pass returns, in one module the torch pass, the Triton pass and the vocab-parallel
split all import (so none of them imports another for its types)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenPassResult:
    """Per-token outputs (fp32/bool, [T]); rows with weight 0 hold zeros."""

    logp: torch.Tensor
    entropy: torch.Tensor
    loss: torch.Tensor  # unweighted per-token objective incl. KL and entropy terms
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    kl: torch.Tensor


@dataclass
class RowStats:
    """Partial log-softmax statistics of each row over the vocab entries a rank holds."""

    max: torch.Tensor  # [T] max_j z'_j (-inf for an empty shard)
    sumexp: torch.Tensor  # [T] sum_j exp(z'_j - max)
    zexp: torch.Tensor  # [T] sum_j exp(z'_j - max) * z'_j   (for the entropy)
    target: torch.Tensor  # [T] z'_target if the target lies in this shard, else 0
