"""Attention over packed variable-length sequences.

``sdpa`` runs one SDPA call per document (CPU forward and backward, any dtype); ``varlen``
calls torch's flash varlen kernel (CUDA, bf16). Both read the same ``VarlenMetadata``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from torchtitan.models.common.attention import VarlenMetadata
from torchtitan.protocols.module import Module

AttentionBackend = Literal["sdpa", "varlen"]
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "varlen")


class VarlenAttention:
    """torch's ``varlen_attn`` bound once to the installed signature.

    torch >= 2.12 refuses fewer KV heads than query heads unless ``enable_gqa=True``; torch 2.11 (the
    GPU image) has no such keyword and hands KV heads straight to the flash kernel, which shares
    them across query groups itself. Passing the keyword there is a TypeError on the first call.
    """

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self.takes_enable_gqa = "enable_gqa" in inspect.signature(fn).parameters

    def __call__(
        self,
        q_TNH: torch.Tensor,
        k_TNH: torch.Tensor,
        v_TNH: torch.Tensor,
        meta: VarlenMetadata,
        *,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        heads_q, heads_kv = q_TNH.shape[1], k_TNH.shape[1]
        if heads_q % heads_kv:
            raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
        gqa = {"enable_gqa": heads_q != heads_kv} if self.takes_enable_gqa else {}
        return self.fn(
            q_TNH,
            k_TNH,
            v_TNH,
            meta.cu_seq_q,
            meta.cu_seq_k,
            meta.max_q,
            meta.max_k,
            scale=scale,
            window_size=(-1, 0) if causal else (-1, -1),
            **gqa,
        )


INSTALLED_VARLEN = VarlenAttention(varlen_attn)


def packed_metadata(cu_seqlens: torch.Tensor, total: int) -> VarlenMetadata:
    """Validate ``cu_seqlens`` against ``total`` tokens; one host read at the forward edge."""
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    host = tuple(int(x) for x in cu_seqlens.tolist())
    if host[0] != 0 or host[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at {total} tokens, got {host[0]}..{host[-1]}")
    lengths = [b - a for a, b in zip(host[:-1], host[1:], strict=True)]
    if min(lengths) <= 0:
        raise ValueError(f"cu_seqlens must be strictly increasing, got {list(host)}")
    cu = cu_seqlens.to(torch.int32)
    return VarlenMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=max(lengths), max_k=max(lengths), cu_seq_q_host=host)


def packed_attention(
    q_TNH: torch.Tensor,
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    meta: VarlenMetadata,
    *,
    causal: bool,
    scale: float | None,
    backend: AttentionBackend,
) -> torch.Tensor:
    """Per-document attention on ``[T, N, H]`` tensors; returns ``[T, Nq, H]``."""
    if backend == "varlen":
        if q_TNH.device.type != "cuda":
            raise ValueError("attention backend 'varlen' needs CUDA tensors; use 'sdpa' on CPU")
        bf16 = (t.to(torch.bfloat16) for t in (q_TNH, k_TNH, v_TNH))
        return INSTALLED_VARLEN(*bf16, meta, causal=causal, scale=scale).to(q_TNH.dtype)
    if backend != "sdpa":
        raise ValueError(f"unknown attention backend {backend!r}; choose from {ATTENTION_BACKENDS}")
    gqa = q_TNH.shape[1] != k_TNH.shape[1]
    bounds = meta.cu_seq_q_host
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        # [1, N, L, H]: torch's fused CPU kernel takes 4-D inputs only (3-D ones fall back to the math path)
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q_TNH, k_TNH, v_TNH))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


class PackedCausalAttention(Module):
    """``inner_attention`` for torchtitan's ``GQAttention`` over one packed row (B == 1)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: AttentionBackend = "sdpa"

    def __init__(self, config: Config):
        super().__init__()
        if config.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {config.backend!r}; choose from {ATTENTION_BACKENDS}")
        self.backend = config.backend

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: VarlenMetadata,
        scale: float | None = None,
        **kwargs,
    ) -> torch.Tensor:
        B, L = q_BLNH.shape[:2]
        q, k, v = (t.reshape(B * L, t.shape[2], t.shape[3]) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = packed_attention(q, k, v, attention_masks, causal=True, scale=scale, backend=self.backend)
        return out.view(B, L, out.shape[1], out.shape[2])
