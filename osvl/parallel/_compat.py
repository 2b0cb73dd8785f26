"""The few places torchtitan assumes a CUDA/NCCL world, adjusted for CPU + gloo.

- torchtitan resolves its device as ``_get_available_device_type() or "cuda"``: on a CPU-only
  host it builds CUDA meshes. ``use_host_device`` points it at the real device.
- The ``spmd_types`` backend needs typed meshes; CPU runs use ``partial_dtensor``.
- gloo has no ``PREMUL_SUM``: FSDP modules are told to reduce with plain SUM.
- FSDP's CPU offload pins host memory, which needs an accelerator: unpinned on CPU-only hosts.
- Tearing down one rank while its peer still has collectives in flight hangs gloo: barrier first.

The torch versions torchtitan assumes are :mod:`osvl.model.version_shims`'s, installed by importing
``osvl.model`` (this module's first import), before torchtitan loads.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

import osvl.model.version_shims  # noqa: F401  installed before torchtitan loads

SPMD_BACKEND = "partial_dtensor"


def host_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_offload_policy() -> CPUOffloadPolicy:
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def use_host_device() -> str:
    """Make torchtitan's module-level device globals match this host; returns the device type."""
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tool_utils

    device = host_device_type()
    module = torch.get_device_module(device)
    for mod in (tool_utils, parallel_dims, dist_utils):
        if hasattr(mod, "device_type"):
            mod.device_type = device
        if hasattr(mod, "device_module"):
            mod.device_module = module
    titan_fsdp.CPUOffloadPolicy = functools.partial(CPUOffloadPolicy, pin_memory=torch.cuda.is_available())
    return device


def use_partial_dtensor() -> None:
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend(SPMD_BACKEND)


def default_backend() -> str:
    """NCCL for CUDA tensors and gloo for host ones on a GPU machine: with ``parallel.cpu_offload`` the
    shards, a checkpoint's and an export's collectives run on host tensors. gloo alone on a CPU host."""
    return "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"


def force_sum_reduction_if_needed(model: nn.Module) -> int:
    """On gloo, make every FSDP module reduce-scatter with SUM; returns how many were changed."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return 0
    changed = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            changed += 1
    return changed


def start_rank(rank: int, world: int, timeout: timedelta | None = None) -> None:
    """What every entry point does first on a rank: torchtitan's device globals for this host, the rank's own GPU
    (``LOCAL_RANK``; before the process group, which NCCL binds to it), and the process group when there are
    several ranks (``timeout``: every collective's; None is torch's default)."""
    use_host_device()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1:
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(default_backend(), rank=rank, world_size=world, **kwargs)


def teardown() -> None:
    """Barrier, then destroy the default process group (no-op when none exists)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
