"""Qwen3-VL's top-k softmax router with fp32 logits and the MoE router losses of training.

torchtitan's router asks for fp32 gate logits with ``torch.autocast(dtype=float32)``, which CPU and
CUDA autocast both refuse (a warning, then autocast is off): with bf16 parameters the logits, the
softmax and the top-k choice were bf16. Here the gate runs in fp32 explicitly (Megatron's
``moe_router_dtype=fp32``, the paper's setting); the chosen experts' weights return in the input dtype,
as in Hugging Face's Qwen3-VL-MoE router.

During training the stage sets ``loss_inputs`` before each micro-batch's forward (see
``osvl.trainer.router_losses``); the router then attaches its load-balance and z-loss terms to its
output (``osvl.model.moe_losses``) and leaves detached statistics in ``stats`` for the step's metrics.
The inputs must stay set until that micro-batch's backward: activation checkpointing re-runs this
forward there and must compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import TokenChoiceTopKRouter

from osvl.model.moe_losses import AuxLossInjector, balance_loss, expert_counts, z_loss_sum


@dataclass(frozen=True)
class RouterLossInputs:
    """One micro-batch's router-loss settings (the same on every MoE layer)."""

    aux_coef: float  # load-balance coefficient per MoE layer (moe.aux_loss_coef)
    z_coef: float  # router z-loss coefficient per MoE layer (moe.z_loss_coef)
    routed_tokens: int  # tokens of real documents: the packed row's prefix before any filler document
    step_tokens: int  # real tokens of the whole optimizer step, all data-parallel ranks together

    def __post_init__(self) -> None:
        if self.aux_coef < 0 or self.z_coef < 0:
            raise ValueError(f"router loss coefficients must be >= 0, got {self.aux_coef}, {self.z_coef}")
        if self.routed_tokens < 0 or self.step_tokens < max(self.routed_tokens, 1):
            raise ValueError(
                f"need 0 <= routed_tokens <= step_tokens and step_tokens >= 1, got "
                f"{self.routed_tokens}, {self.step_tokens}"
            )


@dataclass(frozen=True)
class RouterStats:
    """Detached statistics of one layer on one micro-batch."""

    counts: torch.Tensor  # [E] float32: routed tokens per expert
    balance: torch.Tensor  # 0-d: the layer's load-balance loss (1.0 = uniform), before the coefficient
    z_sum: torch.Tensor  # 0-d: sum over routed tokens of logsumexp(logits)^2
    tokens: int  # routed tokens


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Qwen3VLRouter(TokenChoiceTopKRouter):
    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        if config.score_func != "softmax" or config.num_expert_groups is not None or config.gate.bias:
            raise ValueError("Qwen3VLRouter is Qwen3's router: softmax scores, no expert groups, no gate bias")
        self.loss_inputs: RouterLossInputs | None = None
        self.stats: RouterStats | None = None

    def forward(
        self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (top-k weights in ``x``'s dtype, top-k expert ids, fp32 probabilities over all experts)."""
        dtype = torch.promote_types(x_BLD.dtype, torch.float32)  # fp32, or fp64 in float64 references
        logits_BLE = F.linear(x_BLD.to(dtype), self.gate.weight.to(dtype))
        probs_BLE = F.softmax(logits_BLE, dim=-1)
        choice_BLE = probs_BLE if expert_bias_E is None else probs_BLE + expert_bias_E
        _, ids_BLK = torch.topk(choice_BLE, k=self.top_k, dim=-1, sorted=False)
        scores_BLK = probs_BLE.gather(dim=-1, index=ids_BLK)
        if self.route_norm:
            scores_BLK = scores_BLK / (scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        scores_BLK = (scores_BLK * self.route_scale).to(x_BLD.dtype)
        if self.loss_inputs is not None:
            scores_BLK = self._attach_losses(logits_BLE, probs_BLE, ids_BLK, scores_BLK, self.loss_inputs)
        return scores_BLK, ids_BLK, probs_BLE

    def _attach_losses(
        self,
        logits: torch.Tensor,
        probs: torch.Tensor,
        ids: torch.Tensor,
        scores: torch.Tensor,
        inputs: RouterLossInputs,
    ) -> torch.Tensor:
        """Records this layer's statistics and attaches ``aux_coef * (n / N) * balance + z_coef * z_sum / N``.

        Under tensor parallelism (no EP) every TP rank routes the same tokens (replicated DTensors), so
        the local tensors are the whole micro-batch and the replicated gradient needs no reduction.
        """
        if isinstance(logits, DTensor) and any(p.is_shard() for p in logits.placements):
            raise ValueError(
                "router losses need every token of the micro-batch on each rank; the router input is "
                f"sharded {logits.placements} (tensor x expert parallelism is not supported)"
            )
        logits, probs, ids = _local(logits), _local(probs), _local(ids)
        if logits.shape[0] != 1:
            raise ValueError(f"router losses expect one packed row, got batch {logits.shape[0]}")
        n = inputs.routed_tokens
        if n > logits.shape[1]:
            raise ValueError(f"routed_tokens {n} exceeds the {logits.shape[1]} tokens of the micro-batch")
        mask = (torch.arange(logits.shape[1], device=logits.device) < n).unsqueeze(0)
        counts = expert_counts(ids, mask, self.num_experts)
        prob_sums = (probs * mask.unsqueeze(-1).to(probs.dtype)).sum(dim=(0, 1))
        z_sum = z_loss_sum(logits, mask)
        balance = balance_loss(prob_sums, counts, n, self.top_k) if n else prob_sums.sum() * 0
        self.stats = RouterStats(counts=counts.detach(), balance=balance.detach(), z_sum=z_sum.detach(), tokens=n)
        if n == 0 or not (inputs.aux_coef or inputs.z_coef):
            return scores
        loss = (inputs.aux_coef * n / inputs.step_tokens) * balance + (inputs.z_coef / inputs.step_tokens) * z_sum
        if isinstance(scores, DTensor):
            local = AuxLossInjector.apply(scores.to_local(), loss)
            return DTensor.from_local(local, scores.device_mesh, scores.placements, run_check=False)
        return AuxLossInjector.apply(scores, loss)
