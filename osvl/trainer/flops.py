"""Model FLOPs counted from the architecture and the actual packed lengths, and MFU against a peak table.

Conventions (the torchtitan / PaLM ones, so numbers compare across trainers):
- a matmul with an ``[m, k]`` weight costs ``2·m·k`` FLOPs per token forward; backward costs twice
  the forward (input and weight gradients), so a trained matmul is the ``6·N·tokens`` rule;
- attention scores and the weighted sum cost ``4·heads·head_dim·L²`` per document of length ``L``
  forward, counted as full (non-causal) attention even for the causal decoder, as torchtitan,
  Megatron and ``FlopCounterMode`` do;
- MoE layers count the router and only the ``top_k`` active experts;
- norms, activations, rotary, embeddings lookups and the softmax are not counted (<1% at scale);
- a frozen vision tower runs forward only: nothing upstream of it needs a gradient.

On a tiny model these counts equal ``torch.utils.flop_counter.FlopCounterMode`` exactly, attention on the math path
(see tests).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from osvl.data.packing import PackedBatch
from osvl.model import Qwen3VLConfig
from osvl.model.config import TextConfig, VisionConfig

# Dense bf16 tensor-core TFLOP/s per GPU (no sparsity). First substring match wins, so a name
# that contains another ("H200" contains "H20") comes before it.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H20", 148.0),
)


def text_layer_params(text: TextConfig, layer: int) -> int:
    """Matmul weights one token multiplies through in decoder ``layer`` (active experts only)."""
    d, hd = text.hidden_size, text.head_dim
    attention = d * hd * (2 * text.num_attention_heads + 2 * text.num_key_value_heads)
    if text.is_moe_layer(layer):
        ffn = d * text.num_experts + text.num_experts_per_tok * 3 * d * text.moe_intermediate_size
    else:
        ffn = 3 * d * text.intermediate_size
    return attention + ffn


def text_forward_flops(text: TextConfig, seq_lens: Sequence[int]) -> float:
    """One forward of the decoder and the lm_head over packed documents of ``seq_lens`` tokens."""
    tokens = sum(seq_lens)
    params = sum(text_layer_params(text, i) for i in range(text.num_hidden_layers)) + text.hidden_size * text.vocab_size
    attention = 4 * text.num_attention_heads * text.head_dim * sum(n * n for n in seq_lens) * text.num_hidden_layers
    return 2.0 * params * tokens + attention


def vision_forward_flops(vision: VisionConfig, grids: Iterable[tuple[int, int, int]]) -> float:
    """The vision tower over images of ``(t, h, w)`` patch grids: blocks attend within each frame."""
    d, m2 = vision.hidden_size, vision.spatial_merge_size**2
    merged = vision.merged_size
    block = 4 * d * d + 2 * d * vision.intermediate_size  # qkv + proj, fc1 + fc2
    merger = merged * merged + merged * vision.out_hidden_size
    mergers = 1 + len(vision.deepstack_visual_indexes)
    total = 0.0
    for t, h, w in grids:
        patches = t * h * w
        total += 2.0 * patches * (vision.patch_dim * d + vision.depth * block)
        total += 4.0 * d * t * (h * w) ** 2 * vision.depth
        total += 2.0 * (patches // m2) * merger * mergers
    return total


def train_flops(
    arch: Qwen3VLConfig, seq_lens: Sequence[int], grids: Iterable[tuple[int, int, int]] = (), train_vision: bool = True
) -> float:
    """Forward + backward of one packed micro-batch. A trained tower skips one matmul: pixels need
    no gradient, so the patch embedding's backward is its weight gradient alone."""
    grids = list(grids)
    vision = vision_forward_flops(arch.vision, grids)
    text = 3.0 * text_forward_flops(arch.text, seq_lens)
    if not train_vision:
        return text + vision
    patch_embed = 2.0 * sum(t * h * w for t, h, w in grids) * arch.vision.patch_dim * arch.vision.hidden_size
    return text + 3.0 * vision - patch_embed


def generation_flops(text: TextConfig, turns: Iterable[tuple[int, int]]) -> float:
    """Engine forwards for ``(context_tokens, new_tokens)`` turns: a prefill of the whole context
    (no prefix cache) then one decode step per new token, each attending to everything before it."""
    params = sum(text_layer_params(text, i) for i in range(text.num_hidden_layers)) + text.hidden_size * text.vocab_size
    per_key = 4 * text.num_attention_heads * text.head_dim * text.num_hidden_layers
    total = 0.0
    for context, new in turns:
        total += 2.0 * params * (context + new)
        total += per_key * (context * context + new * context + new * (new + 1) // 2)
    return total


def trajectory_turns(prompt_tokens: int, steps: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(context, new)`` per turn from the prompt length and each step's (generated, observation) token counts."""
    turns, context = [], prompt_tokens
    for generated, observation in steps:
        turns.append((context, generated))
        context += generated + observation
    return turns


def detect_peak_tflops(device_name: str | None) -> float | None:
    """The table's peak for a ``torch.cuda.get_device_name`` string; None when it is not listed."""
    if not device_name:
        return None
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def resolve_peak_tflops(configured: float, device_name: str | None) -> float | None:
    """``metrics.peak_tflops`` when set (> 0), else the table's entry for the device, else None."""
    if configured < 0:
        raise ValueError(f"metrics.peak_tflops must be >= 0 (0 = detect from the device), got {configured}")
    return configured if configured > 0 else detect_peak_tflops(device_name)


def mfu(flops: float, seconds: float, num_devices: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation; None when the peak is unknown (never a made-up number)."""
    if peak_tflops is None:
        return None
    if seconds <= 0 or num_devices < 1 or peak_tflops <= 0:
        raise ValueError(
            f"mfu needs seconds > 0, num_devices >= 1 and peak > 0, got {seconds}, {num_devices}, {peak_tflops}"
        )
    return flops / (seconds * num_devices * peak_tflops * 1e12)


def packed_batch_flops(arch: Qwen3VLConfig, batch: PackedBatch, train_vision: bool = True) -> float:
    """``train_flops`` of a packed micro-batch, from its host-side ``cu_seqlens`` and image grids."""
    bounds = batch.cu_seqlens.tolist()
    grids = [tuple(g) for g in batch.image_grid_thw.tolist()]
    return train_flops(arch, [b - a for a, b in itertools.pairwise(bounds)], grids, train_vision)


def packed_forward_flops(arch: Qwen3VLConfig, batch: PackedBatch) -> float:
    """One no-grad forward of a packed micro-batch (the old policy's log-probs)."""
    bounds = batch.cu_seqlens.tolist()
    grids = [tuple(g) for g in batch.image_grid_thw.tolist()]
    return text_forward_flops(arch.text, [b - a for a, b in itertools.pairwise(bounds)]) + vision_forward_flops(
        arch.vision, grids
    )


def device_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None
