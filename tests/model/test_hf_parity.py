"""Logit parity with transformers' own Qwen3-VL / Qwen3-VL-MoE on tiny random checkpoints."""

import pytest
import torch
import transformers

from osvl.data.mrope import mrope_position_ids
from osvl.model import from_pretrained, save_pretrained
from tests.model.hf_reference import (
    IMAGE_TOKEN,
    hf_logits,
    make_document,
    pixels_for,
    reference_config,
    tiny_hf_model,
)

GRIDS = [[(1, 4, 6), (1, 2, 2)], [], [(1, 6, 4)]]  # three packed documents, two with images


def _packed_parity(hf_model, model, tmp_path):
    gen = torch.Generator().manual_seed(1)
    docs = [make_document(7 + 3 * i, grids, gen) for i, grids in enumerate(GRIDS)]
    patch_dim = model.arch.vision.patch_dim
    pixels = [pixels_for(d.grids, patch_dim, gen) if d.grids else None for d in docs]
    expected = [hf_logits(hf_model, d, p) for d, p in zip(docs, pixels, strict=True)]

    input_ids = torch.cat([d.input_ids for d in docs])
    lengths = [len(d.input_ids) for d in docs]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    # positions from osvl.data (the trainer's packer); transformers computes its own inside hf_logits
    position_ids = torch.cat(
        [torch.from_numpy(mrope_position_ids(d.input_ids.numpy(), d.grids, IMAGE_TOKEN)) for d in docs], dim=1
    )
    grid_thw = torch.tensor([g for d in docs for g in d.grids])
    pixel_values = torch.cat([p for p in pixels if p is not None])
    with torch.no_grad():
        logits = model(
            input_ids, cu_seqlens=cu, position_ids=position_ids, pixel_values=pixel_values, image_grid_thw=grid_thw
        )
    for got, want in zip(logits.split(lengths), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # text-only, positions computed by the model
    text = torch.cat([docs[1].input_ids, docs[1].input_ids[:5]])
    with torch.no_grad():
        got = model(text, cu_seqlens=torch.tensor([0, len(docs[1].input_ids), len(text)], dtype=torch.int32))
    torch.testing.assert_close(got[: len(docs[1].input_ids)], expected[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[len(docs[1].input_ids) :], expected[1][:5], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_match_transformers(moe, tmp_path):
    hf_model = tiny_hf_model(moe)
    hf_model.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.arch == reference_config(moe)  # osvl config -> transformers -> config.json -> osvl is lossless
    _packed_parity(hf_model, model, tmp_path)


def test_transformers_loads_osvl_save(tmp_path):
    """Our save (released expert layout) is read back by transformers with the same logits."""
    hf_model = tiny_hf_model(moe=True, seed=3)
    hf_model.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    save_pretrained(model, tmp_path / "osvl")
    reloaded = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(
        tmp_path / "osvl", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(2)
    doc = make_document(6, [(1, 4, 4)], gen)
    pixels = pixels_for(doc.grids, model.arch.vision.patch_dim, gen)
    torch.testing.assert_close(hf_logits(reloaded, doc, pixels), hf_logits(hf_model, doc, pixels), rtol=1e-5, atol=1e-5)
