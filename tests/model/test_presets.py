"""Released architecture sizes: meta-device parameter counts vs the published totals and vs
transformers' own modules built from the same hyper-parameters."""

import dataclasses

import pytest
import torch

from osvl.model import build_model
from osvl.model.presets import PRESETS, PUBLISHED_PARAMS, preset
from tests.model.hf_reference import hf_module

# Published config.json values, spelled independently of osvl/model/presets.py.
_SHARED_TEXT = {
    "vocab_size": 151936,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5e6,
    "mrope_section": (24, 20, 20),
    "max_position_embeddings": 262144,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
}
_SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_SIZES = {
    "qwen3_vl_8b": (4096, 12288, 36, 32, 8, 0, 0, 0),
    "qwen3_vl_30b_a3b": (2048, 6144, 48, 32, 4, 128, 8, 768),
    "qwen3_vl_32b": (5120, 25600, 64, 64, 8, 0, 0, 0),
}
_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": (8, 16, 24),
    "rope_theta": 10000.0,
    "layer_norm_eps": 1e-6,
}
_TOKENS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("name", sorted(_SIZES))
def test_preset_values_are_pinned(name):
    text = {**_SHARED_TEXT, **dict(zip(_SIZE_KEYS, _SIZES[name], strict=True))}
    vision = {**_VISION, "out_hidden_size": text["hidden_size"]}
    assert dataclasses.asdict(preset(name)) == {"text": text, "vision": vision, **_TOKENS}
    assert sorted(PRESETS) == sorted(_SIZES)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_published_total(name):
    model = build_model(preset(name), device="meta")
    assert abs(_count(model) / PUBLISHED_PARAMS[name] - 1) < 0.005


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_equals_transformers(name):
    with torch.device("meta"):
        hf = hf_module(preset(name))
    assert _count(build_model(preset(name), device="meta")) == _count(hf)


def test_preset_shapes_and_unknown_name():
    moe = preset("qwen3_vl_30b_a3b").text
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert preset("qwen3_vl_8b").text.mrope_section == (24, 20, 20)
    assert preset("qwen3_vl_32b").text.rope_theta == 5e6
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("qwen3_vl_7b")
