"""FSDP2 / TP / EP / activation checkpointing / compile for Qwen3-VL via torchtitan's Qwen3
parallelize path, plus the vision tower's plan: each vision block is its own FSDP unit
(sharded over the data-parallel mesh, replicated across TP ranks — the tower is ~0.5B)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from osvl.config.parallel import PARAM_DTYPES, ParallelConfig
from osvl.model.attention import AttentionBackend
from osvl.model.config import Qwen3VLConfig
from osvl.model.model import Qwen3VLModel, model_config
from osvl.parallel._compat import (
    SPMD_BACKEND,
    cpu_offload_policy,
    force_sum_reduction_if_needed,
    use_host_device,
    use_partial_dtensor,
)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def validate_parallel(parallel: ParallelConfig, arch: Qwen3VLConfig, world_size: int) -> None:
    """The plan's degrees, against the model's heads and experts and against ``world_size`` ranks."""
    p = parallel
    for name in ("dp_replicate", "tp", "ep"):
        if getattr(p, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(p, name)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ValueError(f"dp_shard must be -1 or >= 1, got {p.dp_shard}")
    if p.activation_checkpoint not in ("none", "full", "selective"):
        raise ValueError(f"unknown activation_checkpoint {p.activation_checkpoint!r}")
    if p.param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {sorted(PARAM_DTYPES)}, got {p.param_dtype!r}")
    t = arch.text
    if t.num_attention_heads % p.tp or t.num_key_value_heads % p.tp:
        raise ValueError(
            f"tp={p.tp} must divide num_attention_heads={t.num_attention_heads} "
            f"and num_key_value_heads={t.num_key_value_heads}"
        )
    if p.ep > 1 and (not t.is_moe or t.num_experts % p.ep):
        raise ValueError(f"ep={p.ep} needs an MoE model whose num_experts ({t.num_experts}) it divides")
    if p.ep > 1 and p.tp > 1:
        raise ValueError(
            f"ep={p.ep} with tp={p.tp}: torchtitan's expert-parallel MoE returns token-sharded "
            "outputs that only sequence parallelism can take, and osvl does not enable it; use tp=1 "
            "with ep (FSDP shards the dense weights)"
        )
    dp_shard = p.resolved_dp_shard(world_size)
    if dp_shard * p.dp_replicate * p.tp != world_size:
        raise ValueError(
            f"dp_replicate({p.dp_replicate}) * dp_shard({dp_shard}) * tp({p.tp}) != world_size({world_size})"
        )
    if (dp_shard * p.dp_replicate * p.tp) % p.ep:
        raise ValueError(f"ep={p.ep} must divide the data x tensor parallel ranks")


def parallel_dims(parallel: ParallelConfig, world_size: int) -> ParallelDims:
    """torchtitan's dims for the plan; call ``build_mesh()`` on the result once the process group exists."""
    use_host_device()
    return ParallelDims(
        dp_replicate=parallel.dp_replicate,
        dp_shard=parallel.resolved_dp_shard(world_size),
        cp=1,
        tp=parallel.tp,
        pp=1,
        ep=parallel.ep,
        world_size=world_size,
        spmd_backend=SPMD_BACKEND,
    )


def sharded_model_config(
    arch: Qwen3VLConfig, parallel: ParallelConfig, *, attn_backend: AttentionBackend = "sdpa"
) -> Qwen3VLModel.Config:
    """Model config with torchtitan's Qwen3 TP/EP sharding annotations filled in (before build)."""
    config = model_config(arch, attn_backend=attn_backend)
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=parallel.ep > 1)
    return config


def _shard_vision(model: Qwen3VLModel, dims: ParallelDims, parallel: ParallelConfig) -> None:
    mesh_names = ["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"]
    fsdp = dict(
        mesh=dims.get_mesh(mesh_names),
        mp_policy=MixedPrecisionPolicy(param_dtype=_DTYPES[parallel.param_dtype], reduce_dtype=torch.float32),
    )
    if parallel.cpu_offload:
        fsdp["offload_policy"] = cpu_offload_policy()
    for block in model.visual.blocks:
        fully_shard(block, **fsdp)
    fully_shard(model.visual, **fsdp)


def parallelize(model: Qwen3VLModel, dims: ParallelDims, parallel: ParallelConfig) -> Qwen3VLModel:
    """Apply the plan in place. ``model`` must come from ``sharded_model_config(...).build()``."""
    use_host_device()
    use_partial_dtensor()
    validate_parallel(parallel, model.arch, dims.world_size)
    if parallel.activation_checkpoint == "full":
        ac = FullAC.Config()
    elif parallel.activation_checkpoint == "selective":
        ac = SelectiveAC.Config()
    else:
        ac = None
    if dims.fsdp_enabled:
        _shard_vision(model, dims, parallel)
    parallelize_qwen3(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=parallel.param_dtype, enable_cpu_offload=parallel.cpu_offload),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=parallel.dp_replicate,
            data_parallel_shard_degree=dims.dp_shard,
            tensor_parallel_degree=parallel.tp,
            expert_parallel_degree=parallel.ep,
            enable_sequence_parallel=False,
            fsdp_reshard_after_forward=parallel.reshard_after_forward,
            spmd_backend=SPMD_BACKEND,
        ),
        compile_config=CompileConfig(enable=parallel.compile, components=["model"], backend=parallel.compile_backend),
        ac_config=ac,
        dump_folder="",
        skip_dp=not dims.fsdp_enabled,
    )
    force_sum_reduction_if_needed(model)
    return model


_DATA_PARALLEL_DIMS = ("dp_replicate", "fsdp", "dp_shard", "efsdp")  # FSDP2 pads uneven shards; TP and EP do not


def uneven_splits(model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(parameter, what)`` for every tensor or expert dimension the plan splits unevenly: a TP or EP
    degree must divide the dimension it shards (the fused loss and the attention heads need equal parts)."""
    from osvl.model.init import init_rules

    out = []
    for name, (_, param) in init_rules(model).items():
        if not isinstance(param, DTensor):
            continue
        names = param.device_mesh.mesh_dim_names or ()
        for i, placement in enumerate(param.placements):
            if not isinstance(placement, Shard | _StridedShard) or (i < len(names) and names[i] in _DATA_PARALLEL_DIMS):
                continue
            size, degree = param.shape[placement.dim], param.device_mesh.size(i)
            if size % degree:
                mesh = names[i] if i < len(names) else str(i)
                out.append((name, f"dim {placement.dim} of shape {tuple(param.shape)} into {mesh}={degree} parts"))
    return out


def lm_head_weight(model: Qwen3VLModel) -> torch.Tensor:
    """The output projection as the loss needs it (unsharded while FSDP keeps it gathered)."""
    head = model.lm_head
    if isinstance(head, FSDPModule):
        head.unshard()
    return head.weight
