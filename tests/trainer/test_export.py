"""The stage export's defaults come from the recipe, and a tokenizer the model cannot embed is refused."""

from __future__ import annotations

import json

import pytest
import torch

from osvl.config import load_recipe
from osvl.data.chat_template import trained_prompt
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.model import build_model
from osvl.tools import tool_profile
from osvl.trainer.export import PolicyDefaults, export_model_dir, model_files, policy_defaults
from tests.model.tiny import tiny_config


def test_policy_defaults_follow_the_policy_prompt_and_sampling(tmp_path):
    (tmp_path / "prompt.txt").write_text("Answer briefly.\n")
    recipe = load_recipe(
        "tiny_grpo",
        [
            f"data.system_prompt={tmp_path / 'prompt.txt'}",
            "tools.profile=release",
            "grpo.temperature=0.9",
            "grpo.top_p=0.8",
        ],
    )
    defaults = policy_defaults(recipe)
    assert defaults == PolicyDefaults("Answer briefly.", tuple(tool_profile("release").tool_schemas()), 0.9, 0.8)
    assert policy_defaults(load_recipe("tiny_grpo")).tools == ()  # the paper profile shows no schema


def test_model_files_carry_the_defaults():
    tokenizer = train_bpe_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300)
    files = model_files(tokenizer, ImageConfig(), PolicyDefaults("P.", (), 0.5, 0.9), max_length=128)
    config = json.loads(files["tokenizer_config.json"])
    assert trained_prompt(config["chat_template"]) == ("P.", [])
    generation = json.loads(files["generation_config.json"])
    assert (generation["temperature"], generation["top_p"]) == (0.5, 0.9)
    assert json.loads(files["tokenizer.json"])["added_tokens"][0]["content"] == "<|endoftext|>"


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    tokenizer = train_bpe_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300)
    model = build_model(tiny_config())  # 96 embedding rows
    with pytest.raises(ValueError, match="tokenizer has 300 ids but the model's vocabulary is 96"):
        export_model_dir(model, tmp_path, tokenizer, ImageConfig(), PolicyDefaults(), dtype=torch.float32)
    assert not any(tmp_path.iterdir())  # nothing written
