"""Test helpers: tiny random HF Qwen3-VL models and packed multimodal inputs built from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 5, 6, 3, 4
TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[4, 2, 2], mrope_interleaved=True),
)
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=4,
    out_hidden_size=64,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],
)
TOKENS = dict(
    image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
)


def tiny_hf_model(moe: bool, seed: int = 0):
    torch.manual_seed(seed)
    if moe:
        text = dict(TEXT, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1)
        config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False, **TOKENS)
        model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKENS)
        model = transformers.Qwen3VLForConditionalGeneration(config)
    config._attn_implementation = "eager"
    with torch.no_grad():  # HF inits norms to 1 and some weights to 0; randomise so parity means something
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.float().eval()


@dataclass
class Document:
    input_ids: torch.Tensor  # [L]
    grids: list[tuple[int, int, int]]


def make_document(n_text: int, grids: list[tuple[int, int, int]], gen: torch.Generator) -> Document:
    parts = [torch.randint(10, 128, (n_text,), generator=gen)]
    for t, h, w in grids:
        n = t * h * w // 4
        parts += [torch.tensor([VISION_START]), torch.full((n,), IMAGE_TOKEN), torch.tensor([VISION_END])]
        parts.append(torch.randint(10, 128, (3,), generator=gen))
    return Document(torch.cat(parts), grids)


def pixels_for(grids: list[tuple[int, int, int]], patch_dim: int, gen: torch.Generator) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, patch_dim, generator=gen)


@torch.no_grad()
def hf_logits(hf_model, doc: Document, pixels: torch.Tensor | None) -> torch.Tensor:
    ids = doc.input_ids[None]
    kwargs = {}
    if doc.grids:
        kwargs = dict(
            pixel_values=pixels, image_grid_thw=torch.tensor(doc.grids), mm_token_type_ids=(ids == IMAGE_TOKEN).int()
        )
    return hf_model(input_ids=ids, **kwargs).logits[0]
