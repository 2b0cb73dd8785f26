"""Released architecture sizes: meta-device parameter counts vs the published totals and vs
transformers' own modules built from the same hyper-parameters."""

import pytest
import torch
import transformers

from osvl.model import build_model, config_to_hf
from osvl.model.presets import PRESETS, PUBLISHED_PARAMS, preset


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_published_total(name):
    model = build_model(preset(name), device="meta")
    assert abs(_count(model) / PUBLISHED_PARAMS[name] - 1) < 0.005


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_equals_transformers(name):
    raw = config_to_hf(preset(name))
    cls = transformers.Qwen3VLMoeConfig if preset(name).text.is_moe else transformers.Qwen3VLConfig
    model_cls = (
        transformers.Qwen3VLMoeForConditionalGeneration
        if preset(name).text.is_moe
        else transformers.Qwen3VLForConditionalGeneration
    )
    hf_config = cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dtype")})
    with torch.device("meta"):
        hf = model_cls(hf_config)
    assert _count(build_model(preset(name), device="meta")) == _count(hf)


def test_preset_shapes_and_unknown_name():
    moe = preset("qwen3_vl_30b_a3b").text
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert preset("qwen3_vl_8b").text.mrope_section == (24, 20, 20)
    assert preset("qwen3_vl_32b").text.rope_theta == 5e6
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("qwen3_vl_7b")
