"""Test helpers: tiny random HF Qwen3-VL models and packed multimodal inputs built from them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import transformers

from osvl.model import Qwen3VLConfig, config_to_hf
from tests.model.tiny import IMAGE_TOKEN, VISION_END, VISION_START, VOCAB, tiny_config


def hf_module(config: Qwen3VLConfig) -> transformers.PreTrainedModel:
    """transformers' own Qwen3-VL(-MoE) module, built from the config.json osvl writes for ``config``."""
    raw = config_to_hf(config, dtype="float32")
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dtype")}
    if config.text.is_moe:
        return transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(**kwargs))
    return transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**kwargs))


def reference_config(moe: bool) -> Qwen3VLConfig:
    """``tiny_config`` plus one decoder layer past the DeepStack levels, so parity also covers a layer
    that gets no visual features."""
    config = tiny_config(moe)
    return replace(config, text=replace(config.text, num_hidden_layers=3))


def tiny_hf_model(moe: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = hf_module(reference_config(moe))
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # HF inits norms to 1 and some weights to 0; randomise so parity means something
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.float().eval()


@dataclass
class Document:
    input_ids: torch.Tensor  # [L]
    grids: list[tuple[int, int, int]]


def make_document(n_text: int, grids: list[tuple[int, int, int]], gen: torch.Generator) -> Document:
    parts = [torch.randint(10, VOCAB, (n_text,), generator=gen)]
    for t, h, w in grids:
        n = t * h * w // 4
        parts += [torch.tensor([VISION_START]), torch.full((n,), IMAGE_TOKEN), torch.tensor([VISION_END])]
        parts.append(torch.randint(10, VOCAB, (3,), generator=gen))
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
