"""The trained policy: architecture from the recipe (or the checkpoint), weights, parallel plan, and the
prompt renderer (system prompt, tool schema, image patching) it is trained and served with."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.distributed import rank_device
from osvl.data.formats import checkpoint_image_config
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import SpecialTokens, Tokenizer
from osvl.model import (
    CheckpointError,
    Qwen3VLConfig,
    Qwen3VLModel,
    TextConfig,
    VisionConfig,
    config_from_hf,
    materialize,
    stored_tensors,
)
from osvl.model.checkpoint import checkpoint_sources, load_checkpoint_shards
from osvl.model.init import init_weights
from osvl.model.presets import preset
from osvl.parallel import parallel_dims, parallelize, sharded_model_config, uneven_splits
from osvl.trainer.rng import seed_generators
from osvl.trainer.sft_data import read_system_prompt
from osvl.trainer.tool_env import recipe_profile


@dataclass(frozen=True)
class CPUSize:
    """A CPU preset's shape. ``tied``: the lm_head shares the token embeddings (as Qwen3-VL 2B/4B do)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int = 2
    tied: bool = False


# tiny: unit and end-to-end tests (GQA, MoE). small: make demo, whose policy starts from random weights
# and must copy the names and numbers it reads into its next query and its answer. Copying in context
# needs an induction circuit, which small models of this width form within a few hundred steps with
# tied embeddings and do not form at all untied (scripts/copy_probe.py; docs/demo.md).
CPU_SIZES = {
    "tiny": CPUSize(64, 4, 2, 16, 128),
    "tiny_moe": CPUSize(64, 4, 2, 16, 128),
    "small": CPUSize(128, 4, 4, 32, 256, tied=True),
}


def tiny_arch(vocab_size: int, special: SpecialTokens, size: str = "tiny", layers: int = 0) -> Qwen3VLConfig:
    """A CPU-sized Qwen3-VL whose vocabulary and vision ids follow the tokenizer; ``layers`` > 0
    replaces the size's depth (a deeper ``small`` copies what it reads far better: docs/demo.md).

    RoPE base 1e4, not Qwen3-VL's 5e6: with 16-dim heads only 8 frequencies exist, and at 5e6 all
    but the first two barely turn over a few thousand tokens, leaving little to tell positions apart.
    """
    shape = CPU_SIZES[size]
    moe = size == "tiny_moe"
    quarter = shape.head_dim // 8  # mrope (t, h, w) sections of the head_dim / 2 rotary pairs, 2:1:1
    text = TextConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers or shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        mrope_section=(2 * quarter, quarter, quarter),
        rope_theta=10_000.0,
        num_experts=4 if moe else 0,
        num_experts_per_tok=2 if moe else 0,
        moe_intermediate_size=32 if moe else 0,
    )
    vision = VisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=8,
        out_hidden_size=shape.hidden,
        num_position_embeddings=64,
        deepstack_visual_indexes=(0,),
    )
    return Qwen3VLConfig(
        text=text,
        vision=vision,
        tie_word_embeddings=shape.tied,
        image_token_id=special.image_pad,
        video_token_id=special.video_pad,
        vision_start_token_id=special.vision_start,
        vision_end_token_id=special.vision_end,
    )


def policy_arch(recipe: Recipe, vocab_size: int, special: SpecialTokens) -> Qwen3VLConfig:
    """The checkpoint's architecture when one is given, else the preset."""
    if recipe.model.pretrained:
        config_file = Path(recipe.model.pretrained) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model.pretrained: {config_file} does not exist")
        arch = config_from_hf(json.loads(config_file.read_text()))
        depth = arch.text.num_hidden_layers
        if recipe.model.layers and recipe.model.layers != depth:
            raise ValueError(f"model.layers = {recipe.model.layers}, but {config_file} has {depth} layers")
    elif recipe.model.preset in CPU_SIZES:
        arch = tiny_arch(vocab_size, special, recipe.model.preset, recipe.model.layers)
    else:
        arch = released_width(preset(recipe.model.preset), special, recipe.model.layers)
    if arch.text.vocab_size < vocab_size:
        raise ValueError(f"tokenizer has {vocab_size} ids but the model's vocabulary is {arch.text.vocab_size}")
    if arch.image_token_id != special.image_pad:
        raise ValueError(f"model image_token_id {arch.image_token_id} != tokenizer <|image_pad|> {special.image_pad}")
    return arch


def released_width(arch: Qwen3VLConfig, special: SpecialTokens, layers: int = 0) -> Qwen3VLConfig:
    """A released architecture built from random init: its vision ids are the tokenizer's (a model that
    was never trained has no ids of its own), and ``layers`` > 0 keeps that many decoder layers (a
    GPU-sized cut of the released width, e.g. the device check's training loop) and the DeepStack
    injections that still have a layer."""
    if layers:
        taps = arch.vision.deepstack_visual_indexes[:layers]
        arch = replace(
            arch,
            text=replace(arch.text, num_hidden_layers=layers),
            vision=replace(arch.vision, deepstack_visual_indexes=taps),
        )
    return replace(
        arch,
        image_token_id=special.image_pad,
        video_token_id=special.video_pad,
        vision_start_token_id=special.vision_start,
        vision_end_token_id=special.vision_end,
    )


def policy_image_config(recipe: Recipe, arch: Qwen3VLConfig) -> ImageConfig:
    """How the policy sees images: a checkpoint directory's ``preprocessor_config.json`` when the
    recipe names no tokenizer of its own (the directory is the whole released model), else the
    vision tower's patching with the recipe's pixel budget."""
    v = arch.vision
    own = ImageConfig(
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        merge_size=v.spatial_merge_size,
        min_pixels=recipe.data.min_pixels,
        max_pixels=recipe.data.max_pixels,
    )
    if not recipe.model.pretrained or recipe.data.tokenizer:
        return own
    shipped = checkpoint_image_config(recipe.model.pretrained)
    if shipped is None:
        return own
    expected = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
    found = (shipped.patch_size, shipped.temporal_patch_size, shipped.merge_size)
    if found != expected:
        raise ValueError(
            f"model.pretrained: preprocessor_config.json patches images as (patch, temporal, merge) "
            f"= {found} but the vision tower in config.json expects {expected}"
        )
    return shipped


def policy_prompt(recipe: Recipe) -> tuple[str, list[dict[str, Any]]]:
    """``(system prompt, tool schemas shown)`` of both stages: ``data.system_prompt`` and, for the
    release profile, the release tool schema. The paper profile shows no schema, as osvl's own SFT
    data has none. The exported chat template carries the same pair."""
    tools = recipe_profile(recipe).tool_schemas() if recipe.tools.profile == "release" else []
    return read_system_prompt(recipe.data.system_prompt), tools


def policy_renderer(recipe: Recipe, tokenizer: Tokenizer, arch: Qwen3VLConfig) -> ChatRenderer:
    """The prompt the policy is trained and served on (:func:`policy_prompt`, :func:`policy_image_config`)."""
    system_prompt, tools = policy_prompt(recipe)
    return ChatRenderer(tokenizer, policy_image_config(recipe, arch), tools, system_prompt)


def policy_device(recipe: Recipe) -> torch.device:
    """Where this rank's shards of the policy live: its GPU when there is one (the host with
    ``parallel.cpu_offload``, which FSDP2 moves to the GPU one unit at a time), else the CPU."""
    return torch.device("cpu") if recipe.parallel.cpu_offload else rank_device()


def build_policy(recipe: Recipe, arch: Qwen3VLConfig, world_size: int, *, fill: bool = True) -> Qwen3VLModel:
    """The policy on its parallel plan, each rank holding only its own shards.

    Built on the meta device and sharded there; every check (the checkpoint's files against the
    architecture, the plan's splits) runs before anything is allocated, so a bad input stops every
    rank before it holds memory. Then each rank allocates its shards on its device and fills them:
    from the checkpoint, reading only the slices it owns, or with the seeded init, which is the same
    model whatever the world size and plan (:mod:`osvl.model.init`).

    Gradients are *summed* over data-parallel ranks (divide factor 1): the loss is already divided
    by the global token count, so a mean would shrink every step by the number of ranks.
    """
    seed_generators(recipe.job.seed)
    with torch.device("meta"):
        model = sharded_model_config(arch, recipe.parallel, attn_backend=recipe.model.attn_backend).build()
    pretrained = recipe.model.pretrained if fill else ""
    sources = checkpoint_sources(model, stored_tensors(pretrained)) if pretrained else {}
    if recipe.model.freeze_vision:
        model.visual.requires_grad_(False)
    if dist.is_initialized():
        dims = parallel_dims(recipe.parallel, world_size)
        dims.build_mesh()
        parallelize(model, dims, recipe.parallel)
        uneven = uneven_splits(model)
        if uneven:
            raise CheckpointError(
                "the parallel plan cannot split "
                + "; ".join(_where(name, sources) + f": {problem}" for name, problem in uneven[:4])
            )
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
    materialize(model, policy_device(recipe))
    if sources:
        load_checkpoint_shards(model, sources)
    elif fill:
        init_weights(model, recipe.job.seed)
    return model


def _where(name: str, sources: dict) -> str:
    if name not in sources:
        return name
    source, found = sources[name]
    return f"{found.file}: {source.name!r} ({name})"
