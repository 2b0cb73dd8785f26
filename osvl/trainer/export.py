"""A trained policy as a whole Hugging Face model directory, loaded as it is by transformers, SGLang
and vLLM (the servers of the GRPO topology load what the trainer writes).

Besides ``config.json`` and the safetensors shards (:func:`osvl.model.save_pretrained`, written
collectively from the shards): ``tokenizer.json``; ``tokenizer_config.json`` with the chat template
the policy was trained on (its system prompt and shown tool schema as the defaults, see
:mod:`osvl.data.chat_template`; also as ``chat_template.jinja``, the only place transformers'
processors read it); ``generation_config.json`` (end-of-turn ids, and the stage's sampling
temperature / top-p as the defaults); the image and video processor configs ``AutoProcessor``
needs to build the Qwen3-VL processor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osvl.config.recipe import Recipe
from osvl.data.chat_template import chat_template
from osvl.data.formats.processor import PREPROCESSOR_FILE
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import Tokenizer
from osvl.model import Qwen3VLModel, ShardFile, save_pretrained
from osvl.trainer.policy import policy_prompt

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"


@dataclass(frozen=True)
class PolicyDefaults:
    """What a served policy defaults to: the prompt it was trained with and its sampling."""

    system_prompt: str = ""
    tools: Sequence[Mapping[str, Any]] = field(default_factory=tuple)  # tool schemas shown in the system turn
    temperature: float = 0.7
    top_p: float = 1.0


def policy_defaults(recipe: Recipe) -> PolicyDefaults:
    """The stages' prompt (``data.system_prompt``, the release profile's schema) and GRPO sampling."""
    system_prompt, tools = policy_prompt(recipe)
    return PolicyDefaults(system_prompt, tuple(tools), recipe.grpo.temperature, recipe.grpo.top_p)


def model_files(
    tokenizer: Tokenizer, image_config: ImageConfig, defaults: PolicyDefaults, max_length: int
) -> dict[str, str]:
    """File name -> text of every file of the directory besides the weights and ``config.json``."""
    s = tokenizer.special
    template = chat_template(defaults.system_prompt, defaults.tools)
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": max_length,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": template,
    }
    # no top_k: transformers would take 0 as "off" but SGLang refuses it; osvl samples with none
    generation_config = {
        "bos_token_id": s.endoftext,
        "pad_token_id": s.endoftext,
        "eos_token_id": [s.im_end, s.endoftext],
        "do_sample": True,
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
    }
    files = {
        TOKENIZER_FILE: tokenizer.backend.to_str(pretty=True),
        TOKENIZER_CONFIG_FILE: tokenizer_config,
        CHAT_TEMPLATE_FILE: template,
        GENERATION_CONFIG_FILE: generation_config,
        PREPROCESSOR_FILE: image_config.to_preprocessor_config(),
        VIDEO_PREPROCESSOR_FILE: image_config.to_video_preprocessor_config(),
    }
    return {
        name: body if isinstance(body, str) else json.dumps(body, indent=2, ensure_ascii=False) + "\n"
        for name, body in files.items()
    }


def export_model_dir(
    model: Qwen3VLModel,
    path: str | Path,
    tokenizer: Tokenizer,
    image_config: ImageConfig,
    defaults: PolicyDefaults,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[ShardFile]:
    """Write the whole HF directory. Collective like :func:`osvl.model.save_pretrained` (every rank
    calls it and writes its shards; rank 0 writes the other files); returns once all are on disk."""
    path = Path(path)
    if tokenizer.vocab_size > model.arch.text.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is {model.arch.text.vocab_size}"
        )
    files = model_files(tokenizer, image_config, defaults, model.arch.text.max_position_embeddings)
    plan = save_pretrained(model, path, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name, text in files.items():
            (path / name).write_text(text, encoding="utf-8")
    if dist.is_initialized():
        dist.barrier()
    return plan


def export_stage(
    recipe: Recipe, model: Qwen3VLModel, tokenizer: Tokenizer, image_config: ImageConfig, path: str | Path
) -> list[ShardFile]:
    """A finished stage's ``run_dir/hf``: weights in ``checkpoint.export_dtype``, the stage's prompt
    and sampling as the defaults. Collective."""
    return export_model_dir(
        model,
        path,
        tokenizer,
        image_config,
        policy_defaults(recipe),
        dtype=getattr(torch, recipe.checkpoint.export_dtype),
    )
