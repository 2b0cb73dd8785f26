"""Qwen3-VL (dense and MoE) on torchtitan, with HF checkpoint I/O."""

import osvl.model.version_shims  # noqa: F401  installed before torchtitan loads
from osvl.model.checkpoint import (
    CheckpointError,
    HFTensorSpec,
    ShardFile,
    from_hf_state_dict,
    from_pretrained,
    hf_tensor_specs,
    iter_hf_tensors,
    read_hf_tensors,
    save_pretrained,
    shard_plan,
    stored_tensors,
    to_hf_state_dict,
)
from osvl.model.config import (
    Qwen3VLConfig,
    TextConfig,
    VisionConfig,
    config_from_hf,
    config_to_hf,
)
from osvl.model.model import Qwen3VLModel, build_model, materialize, model_config, text_position_ids

__all__ = [
    "CheckpointError",
    "HFTensorSpec",
    "Qwen3VLConfig",
    "Qwen3VLModel",
    "ShardFile",
    "TextConfig",
    "VisionConfig",
    "build_model",
    "config_from_hf",
    "config_to_hf",
    "from_hf_state_dict",
    "from_pretrained",
    "hf_tensor_specs",
    "iter_hf_tensors",
    "read_hf_tensors",
    "materialize",
    "model_config",
    "save_pretrained",
    "shard_plan",
    "stored_tensors",
    "text_position_ids",
    "to_hf_state_dict",
]
