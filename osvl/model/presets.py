"""Architecture hyper-parameters of the released Qwen3-VL checkpoints the paper trains.

Values are the ``config.json`` fields of Qwen/Qwen3-VL-8B-Instruct, Qwen/Qwen3-VL-30B-A3B-Instruct
and Qwen/Qwen3-VL-32B-Instruct on the Hugging Face Hub. ``PUBLISHED_PARAMS`` are the totals
those model cards report (safetensors metadata: 8.77B, 31.1B, 33.4B).
"""

from __future__ import annotations

from dataclasses import replace

from osvl.model.config import Qwen3VLConfig, TextConfig, VisionConfig

# Every released size shares one vision tower; only its projection width follows the decoder's.
_VISION = VisionConfig(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=(8, 16, 24),
)

# The larger sizes are written as their differences from the 8B decoder.
_TEXT_8B = TextConfig(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


def _with_vision(text: TextConfig) -> Qwen3VLConfig:
    return Qwen3VLConfig(text=text, vision=replace(_VISION, out_hidden_size=text.hidden_size))


PRESETS: dict[str, Qwen3VLConfig] = {
    "qwen3_vl_8b": _with_vision(_TEXT_8B),
    "qwen3_vl_30b_a3b": _with_vision(
        replace(
            _TEXT_8B,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_key_value_heads=4,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
        )
    ),
    "qwen3_vl_32b": _with_vision(
        replace(_TEXT_8B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64)
    ),
}

PUBLISHED_PARAMS: dict[str, float] = {
    "qwen3_vl_8b": 8.77e9,
    "qwen3_vl_30b_a3b": 31.1e9,
    "qwen3_vl_32b": 33.4e9,
}


def preset(name: str) -> Qwen3VLConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]
