"""TRL adapter: a drop-in for GRPOTrainer's fused-linear GRPO loss (`trainer.liger_loss`).

TRL 1.0-1.13 route `compute_loss` through `compute_liger_loss` when `use_liger_kernel=True`, which
calls `self.liger_loss(_input=last_hidden [B, L, H], lin_weight, selected_token_ids [B, L],
attention_mask=loss mask [B, L], advantages [B], bias, old_per_token_logps, ref_per_token_logps,
vllm_is_ratio, num_items_in_batch)` and reads back `(loss, [kl if beta != 0, clip_ratio])`.
(TRL >= 1.14 removed that hook.) Usage::

    trainer = GRPOTrainer(..., args=GRPOConfig(use_liger_kernel=True, ...))
    OsvlFusedLinearGRPOLoss.install(trainer)

The padded batch is packed (the loss mask drops padding and tool tokens) and handed to
`linear_grpo_loss`, so neither padding rows nor [B, L, V] logits are ever computed. Nothing here
imports TRL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from osvl_kernels.integrations.padded import pack, pack_layout
from osvl_kernels.linear_grpo_loss import linear_grpo_loss
from osvl_kernels.token_logprobs import linear_token_logprobs

# TRL loss_type -> osvl loss_agg (TRL's normalisers, see `_compute_loss`).
TRL_LOSS_AGG = {
    "grpo": "seq-mean-token-mean",  # per-sequence token mean, averaged over the B sequences
    "bnpo": "token-mean",  # over the micro-batch's valid tokens
    "dr_grpo": "seq-mean-token-sum-norm",  # / (B * max_completion_length)
    "dapo": "token-mean",  # over num_items_in_batch / world_size
}


class OsvlFusedLinearGRPOLoss(torch.nn.Module):
    """Same constructor keywords and call signature as TRL's `FusedLinearGRPOLoss` for the loss
    types osvl implements; anything else is a ValueError at construction or call time."""

    def __init__(
        self,
        beta: float = 0.04,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: str = "dapo",
        max_completion_length: int | None = None,
        importance_sampling_level: str = "token",
        temperature: float = 1.0,
        delta: float | None = None,
        use_bias_correction_kl: bool = False,
        use_ref_model: bool = True,
        **ignored: Any,
    ) -> None:
        super().__init__()
        if loss_type not in TRL_LOSS_AGG:
            raise ValueError(f"loss_type {loss_type!r} is not supported by osvl; expected one of {tuple(TRL_LOSS_AGG)}")
        if importance_sampling_level != "token":
            raise ValueError(f"only importance_sampling_level='token' is supported, got {importance_sampling_level!r}")
        if delta is not None or use_bias_correction_kl:
            raise ValueError("delta (two-sided clip) and use_bias_correction_kl are not supported by osvl")
        if loss_type == "dr_grpo" and not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        self.beta = beta
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.temperature = temperature
        self.use_ref_model = use_ref_model

    @classmethod
    def from_trainer(cls, trainer: Any) -> "OsvlFusedLinearGRPOLoss":
        """Built from a GRPOTrainer's resolved settings (the ones TRL passes its own loss)."""
        args = trainer.args
        return cls(
            beta=trainer.beta,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            loss_type=trainer.loss_type,
            max_completion_length=trainer.max_completion_length,
            importance_sampling_level=trainer.importance_sampling_level,
            temperature=trainer.temperature,
            delta=getattr(args, "delta", None),
            use_bias_correction_kl=getattr(args, "use_bias_correction_kl", False),
            use_ref_model=trainer.beta != 0.0,
        )

    @classmethod
    def install(cls, trainer: Any) -> "OsvlFusedLinearGRPOLoss":
        """Replace `trainer.liger_loss`; the trainer must run with `use_liger_kernel=True`."""
        if not getattr(trainer, "use_liger_kernel", False) or not hasattr(trainer, "liger_loss"):
            raise ValueError("the GRPOTrainer must be built with use_liger_kernel=True (TRL 1.0-1.13)")
        trainer.liger_loss = cls.from_trainer(trainer)
        return trainer.liger_loss

    def _num_tokens(self, num_valid: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor | None:
        """DAPO's per-process token normaliser, as TRL computes it."""
        if self.loss_type != "dapo":
            return None
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if num_items_in_batch is not None:
            total = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=num_valid.device)
        else:
            total = num_valid.float().clone()
            if distributed:
                dist.all_reduce(total)
        return (total / world).clamp_min(1.0)

    def forward(
        self,
        _input: torch.Tensor,
        lin_weight: torch.Tensor,
        selected_token_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        advantages: torch.Tensor,
        bias: torch.Tensor | None = None,
        ref_per_token_logps: torch.Tensor | None = None,
        old_per_token_logps: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
        vllm_is_ratio: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if bias is not None or ref_bias is not None:
            raise ValueError("lm_head bias is not supported by linear_grpo_loss")
        if vllm_is_ratio is not None:
            raise ValueError("vllm_is_ratio (vLLM importance-sampling correction) is not supported by osvl")
        if _input.dim() != 3:
            raise ValueError(f"_input must be the last hidden state [B, L, H], got {tuple(_input.shape)}")
        if selected_token_ids.shape != _input.shape[:2] or attention_mask.shape != _input.shape[:2]:
            raise ValueError(
                f"selected_token_ids {tuple(selected_token_ids.shape)} and attention_mask "
                f"{tuple(attention_mask.shape)} must be [B, L] = {tuple(_input.shape[:2])}"
            )
        if advantages.shape != _input.shape[:1]:
            raise ValueError(f"advantages must be [B={_input.shape[0]}], got {tuple(advantages.shape)}")
        layout = pack_layout(attention_mask)
        targets = pack(selected_token_ids, layout)
        ref = None
        if self.beta != 0.0:
            if ref_per_token_logps is not None:
                ref = pack(ref_per_token_logps, layout).float()
            elif ref_input is not None and ref_weight is not None:
                ref = linear_token_logprobs(
                    pack(ref_input, layout).detach(), ref_weight.detach(), targets, temperature=self.temperature
                )
        out = linear_grpo_loss(
            pack(_input, layout),
            lin_weight,
            targets,
            layout.cu_seqlens,
            torch.ones_like(targets, dtype=torch.bool),
            old_logprobs=None if old_per_token_logps is None else pack(old_per_token_logps, layout).float(),
            advantages=advantages.float(),
            ref_logprobs=ref,
            eps_low=self.epsilon_low,
            eps_high=self.epsilon_high,
            kl_coef=self.beta if ref is not None else 0.0,
            temperature=self.temperature,
            estimator="grpo",
            loss_agg=TRL_LOSS_AGG[self.loss_type],
            num_tokens=self._num_tokens(layout.cu_seqlens[-1], num_items_in_batch),
            max_response_len=self.max_completion_length if self.loss_type == "dr_grpo" else None,
        )
        metrics = [out.metrics["clip_frac"]]
        if self.beta != 0.0:
            metrics.insert(0, out.metrics["kl_mean"])
        return out.loss, metrics
