"""Routed experts that keep the parameter dtype (torchtitan's ``GroupedExperts`` always
computes in bf16, which breaks fp32 parity and fp32 CPU tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Qwen3VLExperts(GroupedExperts):
    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1_EFD), _local(self.w2_EDF), _local(self.w3_EFD)
        x = x_RD.to(w1.dtype)
        if x.device.type == "cuda":
            offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h = F.silu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offsets))
            h = h * self._grouped_mm(A=x, B_t=w3.transpose(-2, -1), offs=offsets)
            return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offsets).type_as(x_RD)
        # CPU: grouped_mm needs 16-byte aligned strides and has gaps in backward; loop instead.
        outs = []
        for e, xe in enumerate(torch.split(x, num_tokens_per_expert_E.tolist())):
            outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        return torch.cat(outs).type_as(x_RD)
