"""osvl.model.init: counter-based values (distribution, independence of the box they are drawn for), the
rules read from the model, and the seeded build."""

from __future__ import annotations

import math

import pytest
import torch

import osvl.model.init as init
from osvl.model import build_model
from osvl.model.init import InitRule, canonical_name, counter_values, fill_local, init_rules, parameter_key
from tests.model.tiny import tiny_config


def test_values_follow_their_rule():
    index = torch.arange(200_000, dtype=torch.int64)
    normal = counter_values(InitRule("normal", 0.02), parameter_key(0, "w"), index)
    assert abs(normal.mean()) < 0.02 * 5 / math.sqrt(len(index))
    assert normal.std().item() == pytest.approx(0.02, rel=0.01)
    assert abs(((normal / 0.02) ** 3).mean()) < 0.05 and ((normal / 0.02) ** 4).mean() == pytest.approx(3.0, rel=0.05)
    uniform = counter_values(InitRule("uniform", 0.5), parameter_key(0, "w"), index)
    assert uniform.abs().max() <= 0.5 and uniform.var().item() == pytest.approx(0.25 / 3, rel=0.02)
    ones = counter_values(InitRule("constant", 1.0), 0, index)
    assert torch.equal(ones, torch.ones_like(ones))


def test_streams_differ_by_seed_and_name_and_neighbours_are_uncorrelated():
    index = torch.arange(100_000, dtype=torch.int64)
    rule = InitRule("normal", 1.0)
    a = counter_values(rule, parameter_key(0, "layers.0.w"), index)
    b = counter_values(rule, parameter_key(0, "layers.1.w"), index)
    c = counter_values(rule, parameter_key(1, "layers.0.w"), index)
    for x, y in ((a, b), (a, c), (a[:-1], a[1:])):
        assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1]) < 0.02
    assert parameter_key(0, "w") == parameter_key(0, "w") != parameter_key(0, "v")


def test_a_box_gets_the_values_of_the_whole_tensor_at_its_place(monkeypatch):
    """Filling a 3-D tensor at once, in small chunks, or box by box gives the same values."""
    monkeypatch.setattr(init, "CHUNK_ELEMENTS", 7)  # many chunks, some of one row
    rule, key = InitRule("normal", 1.0), 1234
    whole = torch.empty(5, 6, 4)
    fill_local(whole, rule, key)
    expected = counter_values(rule, key, torch.arange(whole.numel()).view(5, 6, 4)).float()
    assert torch.equal(whole, expected)
    for offset, shape in [((1, 2, 0), (3, 2, 4)), ((0, 0, 3), (5, 6, 1)), ((4, 5, 2), (1, 1, 2))]:
        index = [torch.arange(o, o + n) for o, n in zip(offset, shape)]
        flat = (index[0].view(-1, 1, 1) * 24 + index[1].view(1, -1, 1) * 4 + index[2].view(1, 1, -1)).contiguous()
        box = counter_values(rule, key, flat).float()
        assert torch.equal(box, whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


def test_rules_come_from_the_model_and_a_tied_weight_is_initialised_once_as_the_head():
    model = build_model(tiny_config(moe=True, tie=True), device="meta")
    rules = init_rules(model)
    assert "tok_embeddings.weight" not in rules and rules["lm_head.weight"][0] == InitRule("normal", 0.02)
    assert rules["layers.0.moe.routed_experts.inner_experts.w1_EFD"][0] == InitRule("normal", 0.02)
    assert rules["norm.weight"][0] == InitRule("constant", 1.0)
    assert rules["visual.blocks.0.norm1.bias"][0] == InitRule("constant", 0.0)
    fan_in = model.visual.blocks[0].attn.qkv.in_features
    assert rules["visual.blocks.0.attn.qkv.weight"][0] == InitRule("uniform", 1 / math.sqrt(fan_in))
    assert rules["visual.pos_embed.weight"][0] == InitRule("normal", 1.0)
    assert (
        canonical_name("layers.0._checkpoint_wrapped_module.attention._orig_mod.wq.weight")
        == "layers.0.attention.wq.weight"
    )


def test_seeded_build_is_reproducible_and_global_seed_draws_a_fresh_one():
    config = tiny_config(tie=True)
    a, b = build_model(config, seed=3), build_model(config, seed=3)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert a.lm_head.weight is a.tok_embeddings.weight  # the tie survives materialisation
    torch.manual_seed(0)
    c = build_model(config)
    torch.manual_seed(0)
    d = build_model(config)
    assert torch.equal(c.lm_head.weight, d.lm_head.weight) and not torch.equal(c.lm_head.weight, a.lm_head.weight)
    assert build_model(config, device="meta").lm_head.weight.is_meta
