"""TRL adapter: a drop-in for GRPOTrainer's fused-linear GRPO loss (`trainer.liger_loss`).

TRL 1.0-1.13 route `compute_loss` through `compute_liger_loss` when `use_liger_kernel=True`, which
calls `self.liger_loss(_input=last_hidden [B, L, H], lin_weight, selected_token_ids [B, L],
attention_mask=loss mask [B, L], advantages [B], bias, old_per_token_logps, ref_per_token_logps,
vllm_is_ratio, num_items_in_batch)` and reads back `(loss, [kl if beta != 0, clip_ratio])`.
TRL 1.14 removed that hook (1.14-1.16 keep `use_liger_kernel` only for chunked log-probs), so
1.13 is the newest release this adapter can serve; it is tested on 1.13.0. Usage::

    trainer = GRPOTrainer(..., args=GRPOConfig(use_liger_kernel=True, ...))
    OsvlFusedLinearGRPOLoss.install(trainer)

The padded batch is packed (the loss mask drops padding and tool tokens) and handed to
`linear_grpo_loss`, so neither padding rows nor [B, L, V] logits are ever computed. Semantics are
TRL's own `_compute_loss` for loss types grpo, bnpo, dr_grpo and dapo at token-level importance
sampling, including: the vLLM importance-sampling ratio (any `vllm_importance_sampling_mode`)
on the policy-gradient term; `use_bias_correction_kl` (the KL times pi/pi_old) when beta != 0;
`delta` (INTELLECT-2's upper bound on the ratio for negative advantages, which is osvl's dual
clip when delta > 1 + epsilon_high); `cast_lm_head_to_fp32` (half hidden states are upcast to
the fp32 head, as TRL's non-fused path does; TRL's fused path instead rounds the head to the
hidden dtype). Nothing here imports TRL.
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
# Refused, with the reason: these change the surrogate itself, not its aggregation.
TRL_REFUSED_LOSS_TYPES = {
    "cispo": "a detached, clipped ratio times log-prob (no PPO clip)",
    "sapo": "a sigmoid gate instead of the PPO clip",
    "vespo": "a sequence-level gamma weight instead of the PPO clip",
    "luspo": "sequence-level importance sampling",
}


class OsvlFusedLinearGRPOLoss(torch.nn.Module):
    """Same constructor keywords and call signature as TRL's `FusedLinearGRPOLoss` for the loss
    types osvl implements; anything else is a ValueError naming the GRPOConfig field to change."""

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
        if loss_type in TRL_REFUSED_LOSS_TYPES:
            raise ValueError(
                f"GRPOConfig.loss_type={loss_type!r} ({TRL_REFUSED_LOSS_TYPES[loss_type]}) is not implemented by "
                f"osvl; use one of {tuple(TRL_LOSS_AGG)}"
            )
        if loss_type not in TRL_LOSS_AGG:
            raise ValueError(f"GRPOConfig.loss_type={loss_type!r} is unknown; osvl implements {tuple(TRL_LOSS_AGG)}")
        if importance_sampling_level != "token":
            raise ValueError(
                f"GRPOConfig.importance_sampling_level={importance_sampling_level!r} (GSPO) is not implemented by "
                "osvl; set importance_sampling_level='token'"
            )
        if delta is not None and not delta > 1.0 + epsilon_high:
            raise ValueError(
                f"GRPOConfig.delta={delta} must be > 1 + epsilon_high = {1.0 + epsilon_high} for osvl (it is then "
                "osvl's dual clip); set a larger delta or delta=None"
            )
        if loss_type == "dr_grpo" and not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        self.beta = beta
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.temperature = temperature
        self.delta = delta
        # TRL applies the correction only to the KL term, which exists only when beta != 0.
        self.use_bias_correction_kl = use_bias_correction_kl
        self.use_ref_model = use_ref_model

    @classmethod
    def from_trainer(cls, trainer: Any) -> OsvlFusedLinearGRPOLoss:
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
    def install(cls, trainer: Any) -> OsvlFusedLinearGRPOLoss:
        """Replace `trainer.liger_loss`; the trainer must run with `use_liger_kernel=True`."""
        if not getattr(trainer, "use_liger_kernel", False):
            raise ValueError("the GRPOTrainer must be built with GRPOConfig(use_liger_kernel=True) (TRL 1.0-1.13)")
        if not hasattr(trainer, "liger_loss"):
            raise ValueError(
                f"this GRPOTrainer ({type(trainer).__module__}) has no fused-loss hook `liger_loss`: TRL 1.14 removed "
                "it, so osvl's loss plugs into TRL 1.0-1.13 only (tested on 1.13.0)"
            )
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
        if _input.dim() != 3:
            raise ValueError(f"_input must be the last hidden state [B, L, H], got {tuple(_input.shape)}")
        B, L = _input.shape[:2]
        if selected_token_ids.shape != (B, L) or attention_mask.shape != (B, L):
            raise ValueError(
                f"selected_token_ids {tuple(selected_token_ids.shape)} and attention_mask "
                f"{tuple(attention_mask.shape)} must be [B, L] = {(B, L)}"
            )
        if advantages.shape != (B,):
            raise ValueError(f"advantages must be [B={B}], got {tuple(advantages.shape)}")
        if vllm_is_ratio is not None and (vllm_is_ratio.dim() != 2 or vllm_is_ratio.shape not in ((B, L), (B, 1))):
            raise ValueError(f"vllm_is_ratio must be [B, L] = {(B, L)} or [B, 1], got {tuple(vllm_is_ratio.shape)}")
        layout = pack_layout(attention_mask)
        targets = pack(selected_token_ids, layout)
        hidden = pack(_input, layout)
        if hidden.dtype != lin_weight.dtype and lin_weight.dtype == torch.float32:
            hidden = hidden.float()  # cast_lm_head_to_fp32: fp32 logits from half hidden states
        ref = None
        if self.beta != 0.0:
            if ref_per_token_logps is not None:
                ref = pack(ref_per_token_logps, layout).float()
            elif ref_input is not None and ref_weight is not None:
                ref_hidden = pack(ref_input, layout).detach()
                ref_hidden = ref_hidden.to(ref_weight.dtype) if ref_weight.dtype == torch.float32 else ref_hidden
                ref = linear_token_logprobs(ref_hidden, ref_weight.detach(), targets, temperature=self.temperature)
        old = None if old_per_token_logps is None else pack(old_per_token_logps, layout).float()
        is_weights = None
        if vllm_is_ratio is not None:
            is_weights = pack(vllm_is_ratio.detach().float().expand(B, L), layout)
        out = linear_grpo_loss(
            hidden,
            lin_weight,
            targets,
            layout.cu_seqlens,
            torch.ones_like(targets, dtype=torch.bool),
            old_logprobs=old,
            advantages=advantages.float(),
            ref_logprobs=ref,
            eps_low=self.epsilon_low,
            eps_high=self.epsilon_high,
            dual_clip=self.delta,
            kl_coef=self.beta if ref is not None else 0.0,
            kl_is_weighted=self.use_bias_correction_kl and ref is not None,
            temperature=self.temperature,
            estimator="grpo",
            loss_agg=TRL_LOSS_AGG[self.loss_type],
            num_tokens=self._num_tokens(layout.cu_seqlens[-1], num_items_in_batch),
            max_response_len=self.max_completion_length if self.loss_type == "dr_grpo" else None,
            is_weights=is_weights,
        )
        metrics = [self._clip_ratio(out.logprobs, old, advantages, layout.cu_seqlens)]
        if self.beta != 0.0:
            metrics.insert(0, out.metrics["kl_mean"])
        return out.loss, metrics

    def _clip_ratio(
        self, logp: torch.Tensor, old: torch.Tensor | None, advantages: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """TRL's clip_ratio: tokens whose ratio left the clip range on the side their advantage
        pushes it, whatever the importance weight, over the loss tokens."""
        num_tokens = logp.shape[0]
        if old is None:
            return torch.zeros((), device=logp.device)
        with torch.no_grad():
            ratio = torch.exp(logp - old)
            adv = torch.repeat_interleave(advantages.float(), cu_seqlens.diff().long(), output_size=num_tokens)
            clipped = ((ratio < 1.0 - self.epsilon_low) & (adv < 0)) | ((ratio > 1.0 + self.epsilon_high) & (adv > 0))
            return clipped.float().sum() / max(num_tokens, 1)
