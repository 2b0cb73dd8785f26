import pytest
import torch
import torch.nn as nn

from osvl.parallel import (
    ParallelConfig,
    host_device_type,
    parallel_dims,
    teardown,
    use_host_device,
    validate_parallel,
)
from osvl.parallel._compat import cpu_offload_policy, force_sum_reduction_if_needed
from tests.model.tiny import tiny_config


def test_host_device_replaces_torchtitan_cuda_fallback():
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tool_utils

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert use_host_device() == host_device_type() == expected
    assert tool_utils.device_type == parallel_dims.device_type == expected
    assert cpu_offload_policy().pin_memory == torch.cuda.is_available()


def test_compat_helpers_are_no_ops_without_a_process_group():
    assert force_sum_reduction_if_needed(nn.Linear(2, 2)) == 0
    teardown()


def test_parallel_config_resolves_and_validates():
    arch = tiny_config(moe=True)
    cfg = ParallelConfig(tp=2)
    assert cfg.resolved_dp_shard(8) == 4
    validate_parallel(cfg, arch, 8)
    dims = parallel_dims(ParallelConfig(dp_shard=2, ep=2), 2)
    assert (dims.dp_shard, dims.ep, dims.spmd_backend) == (2, 2, "partial_dtensor")
    bad = [
        (ParallelConfig(tp=0), "tp must be >= 1"),
        (ParallelConfig(dp_shard=0), "dp_shard"),
        (ParallelConfig(tp=8, dp_shard=1), "tp=8 must divide"),
        (ParallelConfig(ep=3, dp_shard=6), "ep=3"),
        (ParallelConfig(dp_shard=3), "world_size"),
        (ParallelConfig(activation_checkpoint="sometimes"), "activation_checkpoint"),
        (ParallelConfig(param_dtype="float16"), "param_dtype"),
    ]
    for cfg, match in bad:
        with pytest.raises(ValueError, match=match):
            validate_parallel(cfg, arch, 8 if cfg.dp_shard != 6 else 6)
    with pytest.raises(ValueError, match="MoE"):
        validate_parallel(ParallelConfig(ep=2), tiny_config(moe=False), 2)
