"""The torch versions torchtitan 0.3.0 assumes, provided on older ones.

torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12) at module
level, but only uses it on its ``full_dtensor`` / ``spmd_types`` paths; osvl runs ``partial_dtensor``
(:mod:`osvl.parallel._compat`), which never builds one. On torch 2.11 (the GPU image) a stand-in type
is registered before torchtitan loads, so the rest of torchtitan imports and runs. Importing this
module installs it; ``osvl.model`` imports it first, and ``osvl.parallel`` imports ``osvl.model`` first.
"""

from __future__ import annotations

import torch


def install_version_shims() -> list[str]:
    """Make torchtitan 0.3.0 importable on this torch; returns the names it had to provide."""
    import torch.distributed.fsdp as fsdp

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):

        class DataParallelMeshDims:
            """Stand-in for torch >= 2.12's type; constructing one means a full_dtensor path was taken."""

            def __init__(self, *args, **kwargs) -> None:
                raise RuntimeError(
                    f"torch {torch.__version__} lacks DataParallelMeshDims: use spmd_backend='partial_dtensor'"
                )

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    return added


VERSION_SHIMS = install_version_shims()
