"""The parallel plan's config (``[parallel]``): data, tensor and expert parallel degrees, offload,
activation checkpointing, compile and the parameter dtype. Torch-free and free of
the rest of osvl, so loading a recipe (every CLI does) does not import torchtitan;
:mod:`osvl.parallel.parallelize` checks the plan against a model and a world and applies it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PARAM_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class ParallelConfig:
    dp_shard: int = -1  # -1: whatever world_size / (dp_replicate * tp) leaves
    dp_replicate: int = 1
    tp: int = 1
    ep: int = 1
    cpu_offload: bool = False
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    compile: bool = False  # torch.compile each decoder block (fullgraph)
    compile_backend: str = "inductor"
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    reshard_after_forward: Literal["default", "always", "never"] = "default"

    def resolved_dp_shard(self, world_size: int) -> int:
        if self.dp_shard != -1:
            return self.dp_shard
        return max(world_size // (self.dp_replicate * self.tp), 1)
