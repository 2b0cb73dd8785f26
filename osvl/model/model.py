"""Qwen3-VL on torchtitan: Qwen3 dense / MoE decoder blocks + vision tower + DeepStack +
interleaved MRoPE, with a packed (one row, many documents) forward."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.config_utils import (
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

from osvl.model.attention import (
    AttentionBackend,
    PackedCausalAttention,
    packed_metadata,
)
from osvl.model.config import Qwen3VLConfig
from osvl.model.experts import Qwen3VLExperts
from osvl.model.init import init_buffers, init_weights
from osvl.model.rope import PrecomputedRoPE, mrope_table
from osvl.model.router import Qwen3VLRouter
from osvl.model.vision import VisionTower

_INIT_STD = 0.02
_LINEAR_INIT = {"weight": partial(nn.init.normal_, std=_INIT_STD), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EXPERTS_INIT = {name: partial(nn.init.normal_, std=_INIT_STD) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}


def text_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[3, T]`` positions restarting at 0 in every document (text-only MRoPE)."""
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pos = torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths, output_size=total)
    return pos.view(1, -1).expand(3, -1)


def _like(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Vision outputs and token indices are identical on every TP rank; give them the decoder
    stream's DTensor layout (replicated) so they mix with it."""
    if isinstance(ref, DTensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, ref.device_mesh, ref.placements, run_check=False)
    return x


def _decoder_layer(config: Qwen3VLConfig, layer: int, backend: AttentionBackend) -> Qwen3TransformerBlock.Config:
    t = config.text

    def norm(dim: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=dim, eps=t.rms_norm_eps, param_init=_NORM_INIT)

    attention = make_gqa_config(
        dim=t.hidden_size,
        n_heads=t.num_attention_heads,
        n_kv_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        wqkv_param_init=_LINEAR_INIT,
        wo_param_init=_LINEAR_INIT,
        inner_attention=PackedCausalAttention.Config(backend=backend),
        fuse_qkv=False,
        rope=PrecomputedRoPE.Config(),
        qk_norm=norm(t.head_dim),
    )
    block = dict(attention=attention, attention_norm=norm(t.hidden_size), ffn_norm=norm(t.hidden_size))
    if not t.is_moe_layer(layer):
        ffn = make_ffn_config(
            dim=t.hidden_size, hidden_dim=t.intermediate_size, w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT
        )
        return Qwen3TransformerBlock.Config(**block, feed_forward=ffn)
    routed = make_routed_experts_config(
        dim=t.hidden_size,
        hidden_dim=t.moe_intermediate_size,
        num_experts=t.num_experts,
        top_k=t.num_experts_per_tok,
        param_init=_EXPERTS_INIT,
        comm_backend="standard",
    )
    routed.inner_experts = Qwen3VLExperts.Config(
        dim=t.hidden_size, hidden_dim=t.moe_intermediate_size, num_experts=t.num_experts, param_init=_EXPERTS_INIT
    )
    router = Qwen3VLRouter.Config(
        num_experts=t.num_experts,
        gate=Linear.Config(in_features=t.hidden_size, out_features=t.num_experts, param_init=_LINEAR_INIT),
        top_k=t.num_experts_per_tok,
        score_func="softmax",
        route_norm=True,
    )
    moe = make_moe_config(num_experts=t.num_experts, router=router, routed_experts=routed, load_balance_coeff=None)
    return Qwen3TransformerBlock.Config(**block, moe=moe)


class Qwen3VLModel(Qwen3Model):
    """A torchtitan ``Decoder`` (so its FSDP / TP / EP / AC / compile helpers apply) plus ``visual``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Model.Config):
        arch: Qwen3VLConfig
        visual: VisionTower.Config

    def __init__(self, config: Config):
        super().__init__(config)
        self.arch = config.arch
        self.visual = config.visual.build()

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Packed forward: ``input_ids [T]`` -> logits ``[T, V]`` (or final hidden ``[T, D]``)."""
        a = self.arch
        if input_ids.ndim != 1 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be a 1-D integer tensor, got {tuple(input_ids.shape)} {input_ids.dtype}")
        T = input_ids.shape[0]
        meta = packed_metadata(cu_seqlens, T)
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw must be given together")
        if position_ids is None:
            if pixel_values is not None:
                raise ValueError("image inputs need 3-D MRoPE position_ids [3, T]; text-only positions would be wrong")
            position_ids = text_position_ids(meta.cu_seq_q, T)
        if position_ids.shape != (3, T):
            raise ValueError(f"position_ids must be [3, {T}], got {tuple(position_ids.shape)}")

        h = self.tok_embeddings(input_ids).unsqueeze(0)
        deepstack: list[torch.Tensor] = []
        visual_idx = None
        if pixel_values is not None:
            image_embeds, deepstack = self.visual(pixel_values, image_grid_thw)
            visual_idx = (input_ids == a.image_token_id).nonzero().squeeze(-1)
            if visual_idx.numel() != image_embeds.shape[0]:
                raise ValueError(
                    f"{visual_idx.numel()} image tokens in input_ids but the images give "
                    f"{image_embeds.shape[0]} embeddings"
                )
            h = h.index_copy(1, _like(visual_idx, h), _like(image_embeds.unsqueeze(0).to(h.dtype), h))

        rope = mrope_table(
            position_ids, head_dim=a.text.head_dim, theta=a.text.rope_theta, sections=a.text.mrope_section
        )
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, meta, rope)
            if i < len(deepstack):
                h = h.index_add(1, _like(visual_idx, h), _like(deepstack[i].unsqueeze(0).to(h.dtype), h))
        h = self.norm(h)[0]
        return h if return_hidden else self.lm_head(h)


def model_config(config: Qwen3VLConfig, *, attn_backend: AttentionBackend = "sdpa") -> Qwen3VLModel.Config:
    """The torchtitan config tree for an architecture."""
    config.validate()
    t = config.text
    return Qwen3VLModel.Config(
        arch=config,
        dim=t.hidden_size,
        vocab_size=t.vocab_size,
        enable_weight_tying=config.tie_word_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=t.vocab_size, embedding_dim=t.hidden_size),
        norm=RMSNorm.Config(normalized_shape=t.hidden_size, eps=t.rms_norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=t.hidden_size, out_features=t.vocab_size, param_init=_LINEAR_INIT),
        layers=[_decoder_layer(config, i, attn_backend) for i in range(t.num_hidden_layers)],
        visual=VisionTower.Config(vision=config.vision, backend=attn_backend),
    )


def materialize(model: Qwen3VLModel, device: str | torch.device) -> Qwen3VLModel:
    """Allocate a meta-device model (sharded or not) on ``device``, values unset: each rank allocates only
    its own shards. The modules' buffers are initialised; the caller fills the parameters."""
    model.to_empty(device=device)
    if model.enable_weight_tying:  # to_empty may swap the parameter objects; the tie must survive
        model.tok_embeddings.weight = model.lm_head.weight
    init_buffers(model)
    return model


def build_model(
    config: Qwen3VLConfig,
    *,
    attn_backend: AttentionBackend = "sdpa",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    seed: int | None = None,
) -> Qwen3VLModel:
    """Build on the meta device, then allocate once on ``device`` (``"meta"`` allocates nothing). With
    ``init`` the weights get osvl's seeded init (:mod:`osvl.model.init`; ``seed`` None draws one from
    torch's global generator), without it they are unset memory for a caller that loads them."""
    device = torch.device(device)
    with torch.device("meta"):
        model = model_config(config, attn_backend=attn_backend).build().to(dtype=dtype)
    if device.type == "meta":
        return model
    materialize(model, device)
    if init:
        init_weights(model, int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)
    return model
