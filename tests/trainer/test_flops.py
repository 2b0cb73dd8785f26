"""Model FLOP counts against hand arithmetic and against FlopCounterMode; the peak table; MFU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from osvl.config import load_recipe
from osvl.data.mrope import mrope_position_ids
from osvl.model import Qwen3VLConfig, TextConfig, VisionConfig, build_model
from osvl.trainer import read_metrics, run_sft
from osvl.trainer.flops import (
    detect_peak_tflops,
    generation_flops,
    mfu,
    packed_forward_flops,
    resolve_peak_tflops,
    text_forward_flops,
    text_layer_params,
    train_flops,
    trajectory_turns,
    vision_forward_flops,
)
from tests.trainer.fixtures import sft_overrides

SMALL_TEXT = TextConfig(
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    mrope_section=(1, 1, 0),
)
SMALL_VISION = VisionConfig(
    depth=1,
    hidden_size=8,
    intermediate_size=16,
    num_heads=2,
    patch_size=2,
    out_hidden_size=8,
    num_position_embeddings=4,
    deepstack_visual_indexes=(0,),
)


def test_text_flops_by_hand():
    # q 8x8, k 8x4, v 8x4, o 8x8 = 192; SwiGLU 3 * 8 * 16 = 384
    assert text_layer_params(SMALL_TEXT, 0) == 192 + 384
    # 2 * (576 + lm_head 8*10) * 8 tokens + 4 * heads 2 * head_dim 4 * (3^2 + 5^2) * 1 layer
    assert text_forward_flops(SMALL_TEXT, [3, 5]) == 2 * 656 * 8 + 32 * 34


def test_moe_counts_router_and_active_experts_only():
    moe = TextConfig(**{**vars(SMALL_TEXT), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6})
    # attention 192 + router 8*4 + top-2 experts * 3 * 8 * 6
    assert text_layer_params(moe, 0) == 192 + 32 + 2 * 144


def test_vision_flops_by_hand():
    # one 1x2x4 image: 8 patches of 3*2*2*2 = 24 values, 2 merged tokens of 8*4 = 32 wide
    patch_embed = 2 * 8 * 24 * 8
    block = 2 * 8 * (4 * 64 + 2 * 8 * 16)
    attention = 4 * 8 * 8**2
    mergers = 2 * 2 * (32 * 32 + 32 * 8) * 2  # the final merger and one DeepStack merger
    assert vision_forward_flops(SMALL_VISION, [(1, 2, 4)]) == patch_embed + block + attention + mergers
    arch = Qwen3VLConfig(text=SMALL_TEXT, vision=SMALL_VISION)
    text = text_forward_flops(SMALL_TEXT, [12])
    vision = patch_embed + block + attention + mergers
    assert train_flops(arch, [12], [(1, 2, 4)], train_vision=False) == 3 * text + vision
    assert train_flops(arch, [12], [(1, 2, 4)]) == 3 * text + 3 * vision - patch_embed


def _tiny_arch(moe: bool) -> Qwen3VLConfig:
    text = TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mrope_section=(2, 1, 1),
        num_experts=4 if moe else 0,
        num_experts_per_tok=2 if moe else 0,
        moe_intermediate_size=16 if moe else 0,
    )
    vision = VisionConfig(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        patch_size=4,
        out_hidden_size=32,
        num_position_embeddings=16,
        deepstack_visual_indexes=(0,),
    )
    return Qwen3VLConfig(
        text=text, vision=vision, image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93
    )


@pytest.mark.parametrize("moe", [False, True])
def test_matches_flop_counter_on_forward_backward(moe):
    """Exact, with SDPA held to its math path (bmm, counted full like our convention; FlopCounterMode has no
    formula for torch's fused CPU attention, which the model takes otherwise) and MoE running top-k experts."""
    arch = _tiny_arch(moe)
    torch.manual_seed(0)
    model = build_model(arch)
    grid, lens = (1, 4, 4), [25, 15]
    ids = torch.randint(0, 80, (sum(lens),))
    ids[5:9] = arch.image_token_id  # 16 patches merge 2x2 into 4 image tokens
    positions = np.concatenate(
        [
            mrope_position_ids(ids[:25].numpy(), [grid], arch.image_token_id, 2),
            mrope_position_ids(ids[25:].numpy(), [], arch.image_token_id, 2),
        ],
        axis=1,
    )
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits = model(
            ids,
            cu_seqlens=torch.tensor([0, 25, 40], dtype=torch.int32),
            position_ids=torch.from_numpy(positions),
            pixel_values=torch.randn(16, arch.vision.patch_dim),
            image_grid_thw=torch.tensor([grid]),
        )
        logits.sum().backward()
    assert train_flops(arch, lens, [grid]) == counter.get_total_flops()


@pytest.mark.parametrize("moe", [False, True])
def test_packed_forward_flops_match_flop_counter_without_grad(moe):
    arch = _tiny_arch(moe)
    torch.manual_seed(0)
    model = build_model(arch)
    grid, lens = (1, 4, 4), [25, 15]
    ids = torch.randint(0, 80, (sum(lens),))
    ids[5:9] = arch.image_token_id
    positions = np.concatenate(
        [
            mrope_position_ids(ids[:25].numpy(), [grid], arch.image_token_id, 2),
            mrope_position_ids(ids[25:].numpy(), [], arch.image_token_id, 2),
        ],
        axis=1,
    )
    batch = SimpleNamespace(
        cu_seqlens=torch.tensor([0, 25, 40], dtype=torch.int32), image_grid_thw=torch.tensor([grid])
    )
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(
            ids,
            cu_seqlens=batch.cu_seqlens,
            position_ids=torch.from_numpy(positions),
            pixel_values=torch.randn(16, arch.vision.patch_dim),
            image_grid_thw=batch.image_grid_thw,
        )
    assert packed_forward_flops(arch, batch) == counter.get_total_flops()


def test_generation_flops():
    turns = trajectory_turns(10, [(4, 3), (2, 0)])
    assert turns == [(10, 4), (17, 2)]
    params = text_layer_params(SMALL_TEXT, 0) + 80
    # turn (c, n): 2 * params * (c + n) + 32 * (c^2 + n * c + n (n + 1) / 2)
    expected = 2 * params * 14 + 32 * (100 + 40 + 10) + 2 * params * 19 + 32 * (289 + 34 + 3)
    assert generation_flops(SMALL_TEXT, turns) == expected


def test_peak_table_and_mfu():
    assert detect_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert detect_peak_tflops("NVIDIA H200") == 989.0
    assert detect_peak_tflops("NVIDIA H20") == 148.0
    assert detect_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert detect_peak_tflops("NVIDIA GeForce RTX 4090") is None and detect_peak_tflops(None) is None
    assert resolve_peak_tflops(148.0, "NVIDIA H100 80GB HBM3") == 148.0  # the recipe wins
    assert resolve_peak_tflops(0.0, "NVIDIA H200") == 989.0
    assert resolve_peak_tflops(0.0, None) is None
    assert mfu(989e12, 2.0, 4, 989.0) == pytest.approx(0.125)
    assert mfu(1e12, 1.0, 1, None) is None


def test_bad_mfu_inputs_fail_clearly():
    with pytest.raises(ValueError, match="peak_tflops must be >= 0"):
        resolve_peak_tflops(-1.0, None)
    with pytest.raises(ValueError, match="seconds > 0"):
        mfu(1e12, 0.0, 1, 989.0)


def test_sft_logs_model_tflops_and_mfu_with_a_configured_peak(tmp_path):
    extra = [
        "sft.max_steps=1",
        "metrics.peak_tflops=0.001",
        "metrics.console=false",
        "metrics.tensorboard=false",
        "checkpoint.export_hf=false",
    ]
    run_sft(load_recipe("tiny_sft", sft_overrides(tmp_path / "data", tmp_path / "run", *extra)))
    (m,) = read_metrics(tmp_path / "run")
    assert m["model_tflops"] > 0
    assert m["mfu"] == pytest.approx(m["model_tflops"] / (m["step_time_s"] * 0.001))
