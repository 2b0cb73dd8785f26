"""The text export (Qwen3-VL's language model as a Qwen3 / Qwen3-MoE text checkpoint): transformers'
plain-RoPE Qwen3 on the export gives the logits of osvl's interleaved-MRoPE model on text."""

import json

import pytest
import torch
import transformers

from osvl.model import build_model, hf_tensor_specs, iter_hf_tensors, save_pretrained
from osvl.model.text_export import text_config_to_hf, to_text_hf
from tests.model.tiny import tiny_config


@pytest.mark.parametrize("moe,tie", [(False, False), (False, True), (True, False)], ids=["dense", "tied", "moe"])
def test_transformers_qwen3_on_the_export_gives_osvl_logits_on_text(moe, tie, tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny_config(moe, tie)).eval()
    save_pretrained(model, tmp_path, dtype=torch.float32, text_only=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(7, model.arch.text.vocab_size, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits.double()
        # two packed documents: positions restart at 0 in the second, as in HF's per-row positions
        got = model(ids.flatten(), cu_seqlens=torch.tensor([0, 23, 46], dtype=torch.int32)).double()
    assert want.abs().max() > 0.1  # a random model's logits are not all ~0
    torch.testing.assert_close(got.view_as(want), want, rtol=1e-5, atol=1e-5)


def test_the_export_has_no_vision_tensors_and_the_specs_match_the_stream():
    torch.manual_seed(0)
    model = build_model(tiny_config(moe=True))
    specs = hf_tensor_specs(model, torch.bfloat16, text_only=True)
    streamed = [(name, tuple(t.shape), t.dtype) for name, t in iter_hf_tensors(model, torch.bfloat16, text_only=True)]
    assert [(s.name, s.shape, s.dtype) for s in specs] == streamed
    names = [name for name, *_ in streamed]
    assert not any("visual" in n or "language_model" in n for n in names)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names


def test_split_experts_are_the_fused_projections():
    E, D, F = 3, 4, 5
    gate_up, down = torch.randn(E, D, 2 * F), torch.randn(E, F, D)
    split = dict(
        to_text_hf("model.language_model.layers.2.mlp.experts.gate_up_proj", gate_up)
        + to_text_hf("model.language_model.layers.2.mlp.experts.down_proj", down)
    )
    x = torch.randn(D)
    for e in range(E):  # expert e's SwiGLU, fused vs split
        g, u = (x @ gate_up[e]).split(F)
        fused = (torch.nn.functional.silu(g) * u) @ down[e]
        p = "model.layers.2.mlp.experts."
        sg, su = split[f"{p}{e}.gate_proj.weight"] @ x, split[f"{p}{e}.up_proj.weight"] @ x
        torch.testing.assert_close(split[f"{p}{e}.down_proj.weight"] @ (torch.nn.functional.silu(sg) * su), fused)
    assert to_text_hf("model.visual.blocks.0.attn.qkv.weight", gate_up) == []
    with pytest.raises(ValueError, match="no text-export name"):
        to_text_hf("model.something_else.weight", gate_up)


def test_text_config_carries_the_language_model():
    arch = tiny_config(moe=True)
    config = text_config_to_hf(arch, dtype="float32")
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == arch.text.num_experts
    assert config["rope_theta"] == arch.text.rope_theta and "mrope_section" not in json.dumps(config)
