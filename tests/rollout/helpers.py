"""A tiny tokenizer + model pair that agree on vocabulary and image tokens, and prompt images."""

from __future__ import annotations

import functools

import numpy as np
import torch

from osvl.data.image import ImageConfig
from osvl.data.tokenizer import Tokenizer, train_bpe_tokenizer
from osvl.model import Qwen3VLConfig, TextConfig, VisionConfig, build_model
from osvl.rl.trajectory import Prompt

CORPUS = [
    (
        "<think>I should look it up.</think>\n<tool_call>\n"
        '{"name": "echo", "arguments": {"tag": "bridge"}}\n</tool_call>'
    ),
    "<think>Done.</think>\n<response>1982</response>",
    "Which bridge is shown in the image? The Kessock Bridge opened in 1982.",
    "echo:bridge:pid= New image at index 1. Error: tool call is not valid JSON",
] * 10

IMAGE_CONFIG = ImageConfig(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=64)


@functools.cache
def tokenizer() -> Tokenizer:
    return train_bpe_tokenizer(CORPUS, vocab_size=400)


def model_config(moe: bool = False) -> Qwen3VLConfig:
    tok = tokenizer()
    text = TextConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mrope_section=(2, 1, 1),
        num_experts=4 if moe else 0,
        num_experts_per_tok=2 if moe else 0,
        moe_intermediate_size=12 if moe else 0,
    )
    vision = VisionConfig(
        depth=2,
        hidden_size=16,
        intermediate_size=24,
        num_heads=2,
        patch_size=2,
        out_hidden_size=32,
        num_position_embeddings=16,
        deepstack_visual_indexes=(0, 1),
    )
    s = tok.special
    return Qwen3VLConfig(
        text=text,
        vision=vision,
        image_token_id=s.image_pad,
        video_token_id=s.video_pad,
        vision_start_token_id=s.vision_start,
        vision_end_token_id=s.vision_end,
    )


def tiny_model(seed: int = 0, moe: bool = False):
    torch.manual_seed(seed)
    return build_model(model_config(moe))


def rgb(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def prompts(n: int) -> list[Prompt]:
    return [
        Prompt(
            id=f"p{i}",
            question=f"Which bridge is shown in the image? ({i})",
            images=[rgb(8, 6 + 2 * i, i)],
            answer="1982",
        )
        for i in range(n)
    ]
