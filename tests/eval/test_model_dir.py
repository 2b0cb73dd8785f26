"""Released Qwen3-VL directories: what evaluation reads from them, and the mismatches it refuses."""

from __future__ import annotations

import json
import shutil

import pytest

from osvl.eval.model_dir import load_model_dir
from osvl.model import Qwen3VLConfig, TextConfig, VisionConfig
from osvl.model.config import config_to_hf
from tests.eval.conftest import IMAGE_CONFIG, write_release_files


def _copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "ckpt")


def _edit(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_release_layout_gives_tokenizer_image_processor_and_stop_ids(checkpoint, tokenizer):
    model_dir = load_model_dir(checkpoint)
    s = tokenizer.special
    assert model_dir.model_type == "qwen3_vl" and model_dir.image_config == IMAGE_CONFIG
    assert model_dir.tokenizer.special == s and model_dir.stop_token_ids == tuple(sorted({s.im_end, s.endoftext}))
    assert "<|im_start|>" in model_dir.chat_template
    assert len(list(checkpoint.glob("model-*-of-*.safetensors"))) > 1


def test_tokenizer_only_directory_for_engine_runs(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path)
    (directory / "config.json").unlink()
    (directory / "generation_config.json").unlink()
    model_dir = load_model_dir(directory / "tokenizer.json", require_config=False)
    assert model_dir.model_type is None and model_dir.stop_token_ids == (model_dir.tokenizer.special.im_end,)
    with pytest.raises(ValueError, match="no config.json"):
        load_model_dir(directory)


def test_moe_config_is_accepted(checkpoint, tokenizer, tmp_path):
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
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
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
    directory = tmp_path / "moe"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config_to_hf(config)))
    write_release_files(directory, tokenizer)
    assert load_model_dir(directory).model_type == "qwen3_vl_moe"


@pytest.mark.parametrize(
    "file,change,message",
    [
        ("config.json", {"image_token_id": 5}, "config.json image_token_id=5 but tokenizer.json has <|image_pad|>"),
        ("config.json", {"model_type": "llava"}, "model_type must be"),
        ("preprocessor_config.json", {"patch_size": 1}, "preprocessor_config.json patch_size=1 but config.json"),
        (
            "preprocessor_config.json",
            {"merge_size": 1},
            "merge_size=1 but config.json vision_config spatial_merge_size",
        ),
        ("tokenizer_config.json", {"chat_template": "{{ messages }}"}, "is not ChatML"),
        ("tokenizer_config.json", {"eos_token": "<|nope|>"}, "eos_token '<|nope|>' is not a token"),
        ("generation_config.json", {"eos_token_id": [10**7]}, "eos_token_id 10000000 is not a token"),
    ],
)
def test_mismatched_release_files_are_refused(checkpoint, tmp_path, file, change, message):
    directory = _copy(checkpoint, tmp_path)
    _edit(directory / file, **change)
    with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("[", r"\[")):
        load_model_dir(directory)


def test_missing_or_broken_files_are_clear_errors(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_model_dir(directory)
    (directory / "tokenizer_config.json").unlink()
    (directory / "chat_template.jinja").write_text("<|im_start|>{{ messages }}")
    assert load_model_dir(directory).chat_template.startswith("<|im_start|>")
    (directory / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        load_model_dir(directory)
    with pytest.raises(ValueError, match="model directory not found"):
        load_model_dir(tmp_path / "nowhere")
