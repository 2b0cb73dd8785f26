"""A Qwen3-VL model directory as Hugging Face releases ship it, read for evaluation.

Everything the prompt side needs comes from the directory, never from our defaults: the tokenizer
(``tokenizer.json``, whose added tokens give the special-token ids), the image processor
(``preprocessor_config.json``: patch / merge size, min / max pixels) and the end-of-turn ids
(``generation_config.json`` ``eos_token_id``, ``tokenizer_config.json`` ``eos_token``). The files
are cross-checked against ``config.json``, because a released checkpoint whose tokenizer and
weights disagree on an id would evaluate as garbage without an error. osvl renders Qwen's ChatML
itself; a chat template (in ``tokenizer_config.json``, ``chat_template.jinja`` or
``chat_template.json``) is checked to be ChatML, and one osvl exported also says which system
prompt and tool schema the policy was trained with (``trained_prompt``), which evaluation shows it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osvl.data.chat_template import trained_prompt
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import Tokenizer, load_tokenizer

CHATML_MARKER = "<|im_start|>"
# config.json key -> the tokenizer's special-token name it must equal
TOKEN_ID_KEYS = {
    "image_token_id": "image_pad",
    "video_token_id": "video_pad",
    "vision_start_token_id": "vision_start",
    "vision_end_token_id": "vision_end",
}


@dataclass(frozen=True)
class ModelDir:
    """What evaluation takes from a checkpoint directory besides the weights."""

    path: Path
    tokenizer: Tokenizer
    image_config: ImageConfig
    model_type: str | None  # None: a tokenizer-only directory (``--engine`` runs)
    stop_token_ids: tuple[int, ...]  # the release's end-of-turn ids, on top of <|im_end|>
    chat_template: str | None
    trained_prompt: tuple[str, list[dict[str, Any]]] | None = None  # (system prompt, tools) of an osvl export


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")  # noqa: TRY004 (bad input is a ValueError throughout osvl)
    return value


def _token_text(value: Any) -> str | None:
    """``"<|im_end|>"`` or the AddedToken form ``{"content": "<|im_end|>", ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: Path, tokenizer_config: dict[str, Any] | None) -> str | None:
    if tokenizer_config and isinstance(tokenizer_config.get("chat_template"), str):
        return tokenizer_config["chat_template"]
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    holder = _read_json(directory / "chat_template.json")
    return holder.get("chat_template") if holder and isinstance(holder.get("chat_template"), str) else None


def _stop_ids(
    tokenizer: Tokenizer, tokenizer_config: dict[str, Any] | None, generation_config: dict[str, Any] | None
) -> tuple[int, ...]:
    ids = {tokenizer.special.im_end}
    if generation_config is not None:
        eos = generation_config.get("eos_token_id")
        for token_id in eos if isinstance(eos, list) else [eos] if eos is not None else []:
            if not isinstance(token_id, int) or not 0 <= token_id < tokenizer.vocab_size:
                raise ValueError(
                    f"generation_config.json eos_token_id {token_id!r} is not a token of tokenizer.json "
                    f"(vocabulary {tokenizer.vocab_size})"
                )
            ids.add(token_id)
    text = _token_text((tokenizer_config or {}).get("eos_token"))
    if text is not None:
        token_id = tokenizer.backend.token_to_id(text)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json eos_token {text!r} is not a token of tokenizer.json")
        ids.add(token_id)
    return tuple(sorted(ids))


def _check_config(config: dict[str, Any], tokenizer: Tokenizer, image: ImageConfig) -> str:
    from osvl.model.config import config_from_hf

    model = config_from_hf(config)  # model_type qwen3_vl / qwen3_vl_moe, shapes, rope
    for key, name in TOKEN_ID_KEYS.items():
        if getattr(model, key) != getattr(tokenizer.special, name):
            raise ValueError(
                f"config.json {key}={getattr(model, key)} but tokenizer.json has "
                f"{tokenizer.special.token(name)} at id {getattr(tokenizer.special, name)}"
            )
    if model.text.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"tokenizer.json has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.text.vocab_size}"
        )
    vision = model.vision
    for ours, theirs, value in (
        ("patch_size", "patch_size", vision.patch_size),
        ("temporal_patch_size", "temporal_patch_size", vision.temporal_patch_size),
        ("merge_size", "spatial_merge_size", vision.spatial_merge_size),
    ):
        if getattr(image, ours) != value:
            raise ValueError(
                f"preprocessor_config.json {ours}={getattr(image, ours)} but config.json vision_config {theirs}={value}"
            )
    return str(config["model_type"])


def load_model_dir(path: str | os.PathLike[str], require_config: bool = True) -> ModelDir:
    """Read and cross-check a checkpoint (or, with ``require_config=False``, a tokenizer) directory."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model directory not found: {path}")
    directory = path if path.is_dir() else path.parent
    tokenizer = load_tokenizer(path)
    preprocessor = _read_json(directory / "preprocessor_config.json")
    if preprocessor is None:
        raise ValueError(
            f"no preprocessor_config.json in {directory} (the image processor's patch size and "
            f"min/max pixels come from it)"
        )
    image_config = ImageConfig.from_preprocessor_config(preprocessor)
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    template = _chat_template(directory, tokenizer_config)
    if template is not None and CHATML_MARKER not in template:
        raise ValueError(
            f"the chat template in {directory} is not ChatML (no {CHATML_MARKER}); osvl renders "
            f"Qwen3-VL's ChatML prompts and cannot evaluate this checkpoint faithfully"
        )
    try:
        trained = trained_prompt(template) if template is not None else None
    except ValueError as error:
        raise ValueError(f"the chat template in {directory}: {error}") from None
    config = _read_json(directory / "config.json")
    if config is None and require_config:
        raise ValueError(f"no config.json in {directory}")
    model_type = _check_config(config, tokenizer, image_config) if config is not None else None
    stop = _stop_ids(tokenizer, tokenizer_config, _read_json(directory / "generation_config.json"))
    return ModelDir(directory, tokenizer, image_config, model_type, stop, template, trained)
