"""Parallelism for Qwen3-VL on torchtitan: FSDP2, TP, EP, activation checkpointing, compile,
the CPU/gloo compat shims, and the dry-run memory planner."""

from osvl.config.parallel import ParallelConfig
from osvl.parallel._compat import (
    host_device_type,
    start_rank,
    teardown,
    use_host_device,
    use_partial_dtensor,
)
from osvl.parallel.parallelize import (
    lm_head_weight,
    parallel_dims,
    parallelize,
    sharded_model_config,
    uneven_splits,
    validate_parallel,
)

__all__ = [
    "ParallelConfig",
    "host_device_type",
    "lm_head_weight",
    "parallel_dims",
    "parallelize",
    "sharded_model_config",
    "start_rank",
    "teardown",
    "uneven_splits",
    "use_host_device",
    "use_partial_dtensor",
    "validate_parallel",
]
