"""Typed Qwen3-VL architecture config, read from and written to HF ``config.json``.

One dataclass tree covers the dense and MoE families; ``num_experts == 0`` means dense.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DENSE_MODEL_TYPE = "qwen3_vl"
MOE_MODEL_TYPE = "qwen3_vl_moe"


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 4096
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_size(self) -> int:
        return self.hidden_size * self.spatial_merge_size**2

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim {self.head_dim} must be divisible by 4 (2-D rotary)")
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} must be a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} outside [0, {self.depth})")


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    max_position_embeddings: int = 262144
    attention_bias: bool = False
    # MoE; num_experts == 0 means every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"2*sum(mrope_section {list(self.mrope_section)}) must equal head_dim {self.head_dim}")
        if self.attention_bias:
            raise ValueError("attention_bias=True is not a Qwen3-VL configuration")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(
                f"MoE needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                f"({self.num_experts}) and moe_intermediate_size > 0"
            )


@dataclass(frozen=True)
class Qwen3VLConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False

    @property
    def model_type(self) -> str:
        return MOE_MODEL_TYPE if self.text.is_moe else DENSE_MODEL_TYPE

    def validate(self) -> None:
        self.text.validate()
        self.vision.validate()
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {self.vision.out_hidden_size} != text hidden_size {self.text.hidden_size}"
            )
        if len(self.vision.deepstack_visual_indexes) > self.text.num_hidden_layers:
            raise ValueError("more DeepStack levels than decoder layers")


def _pick(cls: type, raw: dict[str, Any], **overrides: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in raw.items() if k in names}
    kwargs.update(overrides)
    for k, v in kwargs.items():
        if isinstance(v, list):
            kwargs[k] = tuple(v)
    return cls(**kwargs)


def _text_rope(raw: dict[str, Any]) -> dict[str, Any]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 5_000_000.0))
    section = rope.get("mrope_section", (24, 20, 20))
    if rope.get("mrope_interleaved") is False:
        raise ValueError("only interleaved MRoPE (Qwen3-VL) is supported; config has mrope_interleaved=false")
    return {"rope_theta": float(theta), "mrope_section": tuple(section)}


def config_from_hf(raw: dict[str, Any]) -> Qwen3VLConfig:
    """Parse an HF Qwen3-VL / Qwen3-VL-MoE ``config.json`` dict."""
    model_type = raw.get("model_type")
    if model_type not in (DENSE_MODEL_TYPE, MOE_MODEL_TYPE):
        raise ValueError(f"model_type must be {DENSE_MODEL_TYPE!r} or {MOE_MODEL_TYPE!r}, got {model_type!r}")
    if "text_config" not in raw or "vision_config" not in raw:
        raise ValueError("config.json lacks text_config / vision_config")
    t = dict(raw["text_config"])
    if "num_local_experts" in t and "num_experts" not in t:
        t["num_experts"] = t["num_local_experts"]
    text = _pick(TextConfig, t, **_text_rope(t))
    if model_type == MOE_MODEL_TYPE and not text.is_moe:
        raise ValueError("qwen3_vl_moe config without num_experts")
    if model_type == DENSE_MODEL_TYPE and text.is_moe:
        text = dataclasses.replace(text, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    v = dict(raw["vision_config"])
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported vision hidden_act {v['hidden_act']!r}")
    vision_rope = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    vision = _pick(VisionConfig, v, rope_theta=float(vision_rope))
    top = {
        k: raw[k]
        for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        if k in raw
    }
    tie = bool(raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    config = Qwen3VLConfig(text=text, vision=vision, tie_word_embeddings=tie, **top)
    config.validate()
    return config


def hf_decoder_fields(config: Qwen3VLConfig) -> dict[str, Any]:
    """The language model's shape in HF ``config.json`` keys, shared by the Qwen3-VL config's
    ``text_config`` and the text-only export's (``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``)."""
    t = config.text
    fields: dict[str, Any] = {
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    if t.is_moe:
        fields.update(
            num_experts=t.num_experts,
            num_experts_per_tok=t.num_experts_per_tok,
            moe_intermediate_size=t.moe_intermediate_size,
            decoder_sparse_step=t.decoder_sparse_step,
            mlp_only_layers=list(t.mlp_only_layers),
        )
    return fields


def config_to_hf(config: Qwen3VLConfig, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """HF ``config.json`` dict that transformers and vLLM/SGLang load."""
    t, v = config.text, config.vision
    text = {
        "model_type": config.model_type + "_text",
        **hf_decoder_fields(config),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "mrope_section": list(t.mrope_section),
            "mrope_interleaved": True,
        },
        "dtype": dtype,
    }
    vision = {
        "model_type": config.model_type + "_vision",
        "depth": v.depth,
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "out_hidden_size": v.out_hidden_size,
        "num_position_embeddings": v.num_position_embeddings,
        "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
        "hidden_act": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
    arch = "Qwen3VLMoeForConditionalGeneration" if t.is_moe else "Qwen3VLForConditionalGeneration"
    return {
        "architectures": [arch],
        "model_type": config.model_type,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": config.image_token_id,
        "video_token_id": config.video_token_id,
        "vision_start_token_id": config.vision_start_token_id,
        "vision_end_token_id": config.vision_end_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "dtype": dtype,
    }
