"""The parallel plan's config (``[parallel]``): data, tensor and expert parallel degrees, offload,
activation checkpointing, compile and the parameter dtype. Torch-free, so loading a recipe (every
CLI does) does not import torchtitan; :mod:`osvl.parallel.parallelize` applies the plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims

    from osvl.model.config import Qwen3VLConfig

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

    def validate(self, arch: Qwen3VLConfig, world_size: int) -> None:
        for name in ("dp_replicate", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError(f"dp_shard must be -1 or >= 1, got {self.dp_shard}")
        if self.activation_checkpoint not in ("none", "full", "selective"):
            raise ValueError(f"unknown activation_checkpoint {self.activation_checkpoint!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype must be one of {sorted(PARAM_DTYPES)}, got {self.param_dtype!r}")
        t = arch.text
        if t.num_attention_heads % self.tp or t.num_key_value_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} must divide num_attention_heads={t.num_attention_heads} "
                f"and num_key_value_heads={t.num_key_value_heads}"
            )
        if self.ep > 1 and (not t.is_moe or t.num_experts % self.ep):
            raise ValueError(f"ep={self.ep} needs an MoE model whose num_experts ({t.num_experts}) it divides")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(
                f"ep={self.ep} with tp={self.tp}: torchtitan's expert-parallel MoE returns token-sharded "
                "outputs that only sequence parallelism can take, and osvl does not enable it; use tp=1 "
                "with ep (FSDP shards the dense weights)"
            )
        dp_shard = self.resolved_dp_shard(world_size)
        if dp_shard * self.dp_replicate * self.tp != world_size:
            raise ValueError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({dp_shard}) * tp({self.tp}) != world_size({world_size})"
            )
        if (dp_shard * self.dp_replicate * self.tp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide the data x tensor parallel ranks")

    def resolved_dp_shard(self, world_size: int) -> int:
        if self.dp_shard != -1:
            return self.dp_shard
        return max(world_size // (self.dp_replicate * self.tp), 1)

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """Dims for this plan; call ``build_mesh()`` on the result once the process group exists."""
        from torchtitan.distributed import ParallelDims  # here: the recipe loads without torchtitan

        from osvl.parallel._compat import SPMD_BACKEND, use_host_device

        use_host_device()
        return ParallelDims(
            dp_replicate=self.dp_replicate,
            dp_shard=self.resolved_dp_shard(world_size),
            cp=1,
            tp=self.tp,
            pp=1,
            ep=self.ep,
            world_size=world_size,
            spmd_backend=SPMD_BACKEND,
        )
