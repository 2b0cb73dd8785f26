"""Peak bytes of tensor storage allocated and still alive while a block runs (CPU has no allocator
statistics): every op's output storage is tracked until it is freed; storages that existed before
(the model's own shards) are not counted."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self, existing: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.excluded = {self._storage(t)._cdata for t in existing}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    @staticmethod
    def _storage(t: torch.Tensor) -> torch.UntypedStorage:
        return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}  # before a freed address is reused
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = self._storage(t)
                if storage._cdata not in self.excluded and storage._cdata not in self.live:
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
