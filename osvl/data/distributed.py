"""Global loss normalisers: sequences and valid tokens summed over data-parallel ranks.

Each rank sees only its own micro-batches, but a ``seq-mean`` or ``token-mean`` loss must divide
by the totals of the whole step, or ranks with short sequences would weigh more. One all-reduce of
two integers per step; the results stay on the device (no host sync) and are passed to
``osvl_kernels.grpo_loss(num_seqs=..., num_tokens=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from osvl.data.packing import PackedBatch


def rank_device() -> torch.device:
    """This rank's accelerator: its GPU when there is one, else the host. The training loop's tensors
    and every collective's live there (NCCL takes nothing else; gloo runs on the host)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class GlobalNormalizers:
    num_seqs: torch.Tensor  # 0-d int64: real sequences over all ranks
    num_valid_tokens: torch.Tensor  # 0-d int64: loss tokens (before fatal steps) over all ranks


def global_normalizers(
    batches: Sequence[PackedBatch], group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
) -> GlobalNormalizers:
    """Sums this rank's micro-batches, then one SUM all-reduce when a process group is up (on
    ``device``, by default :func:`rank_device`, where the loss consumes them)."""
    device = rank_device() if device is None else device
    local = torch.tensor(
        [sum(b.num_seqs for b in batches), sum(b.num_valid_tokens for b in batches)], dtype=torch.int64, device=device
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return GlobalNormalizers(num_seqs=local[0], num_valid_tokens=local[1])
