"""The CPU sizes of the policy: the preset's shape, the tokenizer's vocabulary, a working model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from osvl.config import load_recipe
from osvl.config.recipe import TINY_PRESETS
from osvl.model.config import config_to_hf
from osvl.trainer.policy import CPU_SIZES, build_policy, policy_arch
from tests.data.helpers import tiny_tokenizer


@pytest.mark.parametrize("size", sorted(CPU_SIZES))
def test_cpu_sizes_build_a_model_of_their_shape(size):
    tokenizer = tiny_tokenizer()
    recipe = load_recipe("tiny_sft", [f"model.preset={size}"])
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    text = arch.text
    shape = CPU_SIZES[size]
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
    )
    assert text.intermediate_size == shape.intermediate and text.num_hidden_layers == shape.layers
    assert arch.tie_word_embeddings == shape.tied
    assert sum(text.mrope_section) == shape.head_dim // 2 and arch.vision.out_hidden_size == shape.hidden
    assert text.vocab_size == tokenizer.vocab_size and arch.image_token_id == tokenizer.special.image_pad
    assert (text.num_experts > 0) == (size == "tiny_moe")
    model = build_policy(recipe, arch, world_size=1)
    ids = torch.tensor(tokenizer.encode("The population of Zelfen is 72000."))
    with torch.no_grad():
        logits = model(ids, cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32))
    assert logits.shape == (len(ids), tokenizer.vocab_size) and torch.isfinite(logits).all()
    if shape.tied:  # one matrix embeds and unembeds, initialised at the linear layers' scale
        assert model.lm_head.weight is model.tok_embeddings.weight and model.lm_head.weight.std() < 0.05


def test_small_is_the_demo_size_and_wider_than_tiny():
    assert CPU_SIZES["small"].hidden == 2 * CPU_SIZES["tiny"].hidden and CPU_SIZES["small"].tied
    assert set(TINY_PRESETS) == set(CPU_SIZES)  # the recipe's list of CPU presets and the sizes agree
    with pytest.raises(ValueError, match="preset must be one of"):
        load_recipe("tiny_sft", ["model.preset=medium"])
    assert dataclasses.asdict(load_recipe("tiny_sft", ["model.preset=small"]).model)["preset"] == "small"


def test_layers_deepens_a_cpu_preset_and_must_match_a_checkpoint(tmp_path):
    tokenizer = tiny_tokenizer()
    recipe = load_recipe("tiny_sft", ["model.preset=small", "model.layers=4"])
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    assert arch.text.num_hidden_layers == 4 and CPU_SIZES["small"].layers == 2  # the preset itself is unchanged
    default = policy_arch(load_recipe("tiny_sft", ["model.preset=small"]), tokenizer.vocab_size, tokenizer.special)
    assert dataclasses.replace(arch.text, num_hidden_layers=2) == default.text  # depth is the only difference
    model = build_policy(recipe, arch, world_size=1)
    assert len(model.layers) == 4
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(config_to_hf(arch)))
    pretrained = f"model.pretrained={checkpoint}"
    from_checkpoint = policy_arch(load_recipe("tiny_sft", [pretrained]), tokenizer.vocab_size, tokenizer.special)
    assert from_checkpoint.text.num_hidden_layers == 4
    with pytest.raises(ValueError, match="model.layers = 2, but .* has 4 layers"):
        policy_arch(load_recipe("tiny_sft", [pretrained, "model.layers=2"]), tokenizer.vocab_size, tokenizer.special)
    with pytest.raises(ValueError, match="layers must be >= 0"):
        load_recipe("tiny_sft", ["model.layers=-1"])
    cut = policy_arch(
        load_recipe("sft_8b", ["model.layers=2", "model.pretrained="]), tokenizer.vocab_size, tokenizer.special
    )
    assert cut.text.num_hidden_layers == 2 and cut.text.hidden_size == 4096  # a released width, a few layers
    assert (cut.image_token_id, cut.vision_start_token_id) == (
        tokenizer.special.image_pad,
        tokenizer.special.vision_start,
    )
