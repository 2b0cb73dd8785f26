"""Parallelism for Qwen3-VL on torchtitan: FSDP2, TP, EP, activation checkpointing, compile,
the CPU/gloo compat shims, and the dry-run memory planner."""

from osvl.config.parallel import ParallelConfig
from osvl.parallel._compat import (
    host_device_type,
    teardown,
    use_host_device,
    use_partial_dtensor,
)
from osvl.parallel.parallelize import parallelize, sharded_model_config

__all__ = [
    "ParallelConfig",
    "host_device_type",
    "parallelize",
    "sharded_model_config",
    "teardown",
    "use_host_device",
    "use_partial_dtensor",
]
