"""One mini-world with its curated held-out prompts, and a tiny random checkpoint, per session."""

from __future__ import annotations

import json

import pytest
import torch

from osvl.data.chat import system_text
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.eval.modes import system_prompt
from osvl.model import (
    Qwen3VLConfig,
    TextConfig,
    VisionConfig,
    build_model,
    save_pretrained,
)
from osvl.rl.trajectory import read_prompts
from osvl.synth.pipeline import CurationConfig, curate
from osvl.tools import tool_schemas
from osvl.world import WorldConfig, build_world, load_world

IMAGE_CONFIG = ImageConfig(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=64)


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    build_world(root, WorldConfig(seed=0))
    return root


@pytest.fixture(scope="session")
def held_out(world_dir, tmp_path_factory):
    """The curated RL prompts file: the held-out question set of the mini-world."""
    out = tmp_path_factory.mktemp("curated")
    curate(load_world(world_dir), out, CurationConfig(seed=0))
    path = out / "rl" / "prompts.jsonl"
    assert sum(1 for _ in read_prompts(path)) >= 4
    return path


@pytest.fixture(scope="session")
def tokenizer(held_out):
    corpus = [
        system_text(tool_schemas(), system_prompt("agent_system.v1.txt")),
        system_text((), system_prompt("direct_system.v1.txt")),
        (
            "<think>Search first.</think>\n<tool_call>\n"
            '{"name": "text_search", "arguments": {"query": "orchid"}}\n</tool_call>'
        ),
        "<think>Done.</think>\n<response>1926</response>",
    ]
    corpus += [p.question + " " + p.answer for p in read_prompts(held_out)]
    return train_bpe_tokenizer(corpus * 4, vocab_size=1200)


@pytest.fixture(scope="session")
def checkpoint(tokenizer, tmp_path_factory):
    s = tokenizer.special
    text = TextConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mrope_section=(2, 1, 1),
    )
    vision = VisionConfig(
        depth=1,
        hidden_size=16,
        intermediate_size=24,
        num_heads=2,
        patch_size=2,
        out_hidden_size=32,
        num_position_embeddings=16,
        deepstack_visual_indexes=(0,),
    )
    config = Qwen3VLConfig(
        text=text,
        vision=vision,
        image_token_id=s.image_pad,
        video_token_id=s.video_pad,
        vision_start_token_id=s.vision_start,
        vision_end_token_id=s.vision_end,
    )
    torch.manual_seed(0)
    model = build_model(config)
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, path, max_shard_bytes=40_000)  # several shards + index, as the releases ship
    assert (path / "model.safetensors.index.json").is_file()
    write_release_files(path, tokenizer)
    return path


def write_release_files(path, tokenizer, preprocessor=None, tokenizer_config=None):
    """The non-weight files of a released Qwen3-VL directory, written by hand in their HF layout."""
    s = tokenizer.special
    tokenizer.save(path / "tokenizer.json")
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            preprocessor
            or {
                "image_processor_type": "Qwen2VLImageProcessorFast",
                "processor_class": "Qwen3VLProcessor",
                "patch_size": 2,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "size": {"shortest_edge": IMAGE_CONFIG.min_pixels, "longest_edge": IMAGE_CONFIG.max_pixels},
            }
        )
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            tokenizer_config
            or {
                "tokenizer_class": "Qwen2Tokenizer",
                "model_max_length": 262144,
                "pad_token": "<|endoftext|>",
                "eos_token": {"content": "<|im_end|>", "special": True},
                "chat_template": CHATML_TEMPLATE,
            }
        )
    )
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [s.im_end, s.endoftext], "pad_token_id": s.endoftext})
    )


# A minimal ChatML template of our own (the release's is longer; only the turn markers matter here).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
