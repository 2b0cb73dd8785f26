"""osvl/model/version_shims.py: torchtitan 0.3.0 imports on a torch without
DataParallelMeshDims (2.11, the GPU image), and nothing can silently use the stand-in."""

from __future__ import annotations

import pytest
import torch.distributed.fsdp as fsdp

from osvl.model.version_shims import install_version_shims
from osvl.parallel._compat import SPMD_BACKEND


def test_missing_data_parallel_mesh_dims_gets_a_stand_in_that_refuses_use(monkeypatch):
    if hasattr(fsdp, "DataParallelMeshDims"):
        monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    assert install_version_shims() == ["torch.distributed.fsdp.DataParallelMeshDims"]
    with pytest.raises(RuntimeError, match=SPMD_BACKEND):
        fsdp.DataParallelMeshDims()
    assert install_version_shims() == []  # idempotent


def test_a_torch_that_has_it_is_left_alone(monkeypatch):
    sentinel = type("DataParallelMeshDims", (), {})
    monkeypatch.setattr(fsdp, "DataParallelMeshDims", sentinel, raising=False)
    assert install_version_shims() == [] and fsdp.DataParallelMeshDims is sentinel
