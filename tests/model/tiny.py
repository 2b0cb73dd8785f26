"""Tiny osvl-native configs for fast model tests; the one place test-model sizes are spelled."""

import torch

from osvl.model import Qwen3VLConfig, TextConfig, VisionConfig

VOCAB = 96
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 5, 6, 3, 4


def tiny_config(moe: bool = False, tie: bool = False) -> Qwen3VLConfig:
    text = TextConfig(
        vocab_size=VOCAB,
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
    return Qwen3VLConfig(
        text=text,
        vision=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tie,
    )


def image_batch(config, grids, n_text=4, seed=0):
    """One document per grid: text, image tokens, text. Positions: text runs then an (h, w) grid."""
    gen = torch.Generator().manual_seed(seed)
    ids, pos, lengths = [], [], []
    for t, h, w in grids:
        n_img = t * h * w // 4
        ids += [
            torch.randint(10, VOCAB, (n_text,), generator=gen),
            torch.full((n_img,), IMAGE_TOKEN),
            torch.randint(10, VOCAB, (n_text,), generator=gen),
        ]
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // 2), torch.arange(w // 2), indexing="ij"))
        img_pos = grid.reshape(3, -1) + n_text
        after = torch.arange(n_text).expand(3, -1) + n_text + max(h, w) // 2
        pos += [torch.arange(n_text).expand(3, -1), img_pos, after]
        lengths.append(2 * n_text + n_img)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), config.vision.patch_dim, generator=gen)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return torch.cat(ids), cu, torch.cat(pos, dim=1), pixels, torch.tensor(grids), lengths
