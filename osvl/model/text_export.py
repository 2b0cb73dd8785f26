"""Qwen3-VL's language model as a plain Qwen3 (dense) or Qwen3-MoE text checkpoint.

Engines that cannot run Qwen3-VL's vision stack (vLLM's CPU build: its torchvision wheel does
not load under the CPU torch) still serve the policy's text turns from this export. For text-only
inputs the two models are the same function: the image placeholders never occur, DeepStack adds
nothing, and interleaved MRoPE with equal temporal/height/width positions rotates every frequency
by the same position, which is plain RoPE (``tests/model/test_text_export.py`` checks the logits
against transformers' Qwen3 on the export).

Names: ``model.language_model.*`` -> ``model.*``, the vision tower dropped, and MoE experts split
from the fused ``gate_up_proj`` / ``down_proj`` into Qwen3-MoE's per-expert projections.
"""

from __future__ import annotations

from typing import Any

import torch

from osvl.model.config import Qwen3VLConfig, hf_decoder_fields

VL_TEXT_PREFIX = "model.language_model."
VL_VISUAL_PREFIX = "model.visual."


def text_config_to_hf(config: Qwen3VLConfig, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """``config.json`` of the text export (``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``)."""
    t = config.text
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if t.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if t.is_moe else "qwen3",
        **hf_decoder_fields(config),
        "rope_theta": t.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta},
        "use_sliding_window": False,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if t.is_moe:
        out["norm_topk_prob"] = True
    return out


def to_text_hf(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One tensor of the Qwen3-VL HF layout (released expert layout) as the text export's tensors."""
    if name.startswith(VL_VISUAL_PREFIX):
        return []
    if name == "lm_head.weight":
        return [(name, tensor)]
    if not name.startswith(VL_TEXT_PREFIX):
        raise ValueError(f"no text-export name for {name!r}")
    text = "model." + name[len(VL_TEXT_PREFIX) :]
    if text.endswith(".mlp.experts.gate_up_proj"):  # [E, D, 2F]
        base = text.removesuffix("gate_up_proj")
        gate, up = tensor.chunk(2, dim=2)
        return [
            pair
            for e in range(tensor.shape[0])
            for pair in (
                (f"{base}{e}.gate_proj.weight", gate[e].t().contiguous()),
                (f"{base}{e}.up_proj.weight", up[e].t().contiguous()),
            )
        ]
    if text.endswith(".mlp.experts.down_proj"):  # [E, F, D]
        base = text.removesuffix("down_proj")
        return [(f"{base}{e}.down_proj.weight", tensor[e].t().contiguous()) for e in range(tensor.shape[0])]
    return [(text, tensor)]
