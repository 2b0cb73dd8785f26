"""TRL adapter: osvl's fused lm_head + GRPO loss as the loss of TRL's `GRPOTrainer` (TRL 1.16).

TRL 1.0-1.13 called a replaceable fused-loss module (`trainer.liger_loss`); TRL 1.14 removed it, and since then the
loss hook GRPOTrainer offers is the one every transformers `Trainer` has: `compute_loss(model, inputs, ...)`, which
TRL routes to `_compute_loss` (full per-token log-probs from a chunked lm_head, then the surrogate). `install(trainer)`
replaces that `compute_loss` on the trainer instance: the policy's backbone runs (no lm_head) and its last hidden
states at the completion positions [B, L, H], the lm_head weight and TRL's batch (completion ids,
completion_mask x tool_mask, advantages, old and reference log-probs, the vLLM importance-sampling ratio,
num_items_in_batch) go to `OsvlFusedLinearGRPOLoss`, which packs the loss tokens and hands them to
`linear_grpo_loss`: neither padding rows nor [B, L, V] logits are computed. Usage::

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(loss_type="dapo", ...), train_dataset=...)
    OsvlFusedLinearGRPOLoss.install(trainer)

Semantics are TRL 1.16's `_compute_loss` for loss types grpo, bnpo, dr_grpo and dapo at token-level importance
sampling, with its gradient-accumulation normalisers, including: the vLLM importance-sampling ratio (any
`vllm_importance_sampling_mode`) on the policy-gradient term; `use_bias_correction_kl` (the KL times pi/pi_old) when
beta != 0; `delta` (INTELLECT-2's upper bound on the ratio for negative advantages, which is osvl's dual clip when
delta > 1 + epsilon_high); `cast_lm_head_to_fp32` (half hidden states are upcast to the fp32 head). The metrics TRL
logs for these loss types (kl, entropy, clip_ratio/{low,high,region}_mean) are logged the same way. Nothing here
imports TRL.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from osvl_kernels.grpo_loss import GRPOLossOutput
from osvl_kernels.integrations.padded import PackedLayout, pack, pack_layout
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
# GRPOTrainer settings its _compute_loss applies and the fused loss does not: (is it on?, GRPOConfig field, what it is).
TRL_REFUSED_SETTINGS: list[tuple[Callable[[Any], bool], str, str]] = [
    (lambda t: t.top_entropy_quantile < 1.0, "top_entropy_quantile", "a mask of the low-entropy tokens"),
    (lambda t: t.off_policy_mask_threshold is not None, "off_policy_mask_threshold", "an off-policy sequence mask"),
    (lambda t: t._entropy_bonus_enabled, "entropy_coef", "an entropy bonus with its own normaliser"),
    (lambda t: t.aux_loss_enabled, "router_aux_loss_coef", "the MoE load-balancing loss"),
]
# Model configs whose logits are not hidden @ lm_head.T (capped or scaled): refused.
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)
# The batch keys GRPOTrainer passes the model besides the token ids (vision inputs, token types).
MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class OsvlFusedLinearGRPOLoss(torch.nn.Module):
    """The fused loss on TRL's padded batch. Takes the constructor and call keywords of Liger's
    `LigerFusedLinearGRPOLoss` (which TRL 1.0-1.13's fused loss shared) for the loss types osvl implements; anything
    else is a ValueError naming the GRPOConfig field to change."""

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

    @classmethod
    def from_trainer(cls, trainer: Any) -> OsvlFusedLinearGRPOLoss:
        """Built from a GRPOTrainer's resolved settings (the ones its `_compute_loss` reads)."""
        for enabled, field, what in TRL_REFUSED_SETTINGS:
            if enabled(trainer):
                raise ValueError(f"GRPOConfig.{field} ({what}) is not implemented by osvl's fused loss; leave it off")
        return cls(
            beta=trainer.beta,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            loss_type=trainer.loss_type,
            max_completion_length=trainer.max_completion_length,
            importance_sampling_level=trainer.importance_sampling_level,
            temperature=trainer.temperature,
            delta=trainer.args.delta,
            use_bias_correction_kl=trainer.args.use_bias_correction_kl,
        )

    @classmethod
    def install(cls, trainer: Any) -> OsvlFusedLinearGRPOLoss:
        """Make `trainer.compute_loss` osvl's fused loss (kept as `trainer.osvl_loss`); returns the loss module."""
        model = causal_lm(trainer.model)
        config = model.config.get_text_config()
        transforms = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1.0)]
        if transforms:
            raise ValueError(f"the model's logits are not hidden @ lm_head.T ({transforms}); osvl cannot fuse them")
        if model.get_output_embeddings().bias is not None:
            raise ValueError("lm_head bias is not supported by linear_grpo_loss")
        trainer.osvl_loss = cls.from_trainer(trainer)
        trainer.compute_loss = types.MethodType(fused_compute_loss, trainer)
        return trainer.osvl_loss

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

    def packed_loss(
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
    ) -> tuple[GRPOLossOutput, PackedLayout, torch.Tensor | None, torch.Tensor | None]:
        """`linear_grpo_loss` on the loss tokens; also returns the layout and the packed old and reference
        log-probs the metrics need."""
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
        return out, layout, old, ref

    def forward(self, **batch: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(loss, [kl if beta != 0, clip_ratio]), as Liger's loss returns them."""
        out, layout, old, _ = self.packed_loss(**batch)
        low, high = self.clipped(out.logprobs, old, batch["advantages"], layout.cu_seqlens)
        num_tokens = max(out.logprobs.shape[0], 1)
        metrics = [(low | high).float().sum() / num_tokens]
        if self.beta != 0.0:
            metrics.insert(0, out.metrics["kl_mean"])
        return out.loss, metrics

    def clipped(
        self, logp: torch.Tensor, old: torch.Tensor | None, advantages: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TRL's clip flags per loss token: the ratio left the clip range on the side its advantage pushes it
        (below 1 - epsilon_low with A < 0, above 1 + epsilon_high with A > 0), whatever the importance weight."""
        if old is None:
            none = torch.zeros_like(logp, dtype=torch.bool)
            return none, none
        with torch.no_grad():
            ratio = torch.exp(logp - old)
            adv = torch.repeat_interleave(advantages.float(), cu_seqlens.diff().long(), output_size=logp.shape[0])
            return (ratio < 1.0 - self.epsilon_low) & (adv < 0), (ratio > 1.0 + self.epsilon_high) & (adv > 0)


def causal_lm(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (its LoRA layers stay in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def through_forward(wrapper: torch.nn.Module, module: torch.nn.Module, step: Callable[[], Any]) -> Any:
    """Runs `step` as `module`'s forward, called as `wrapper()` (DDP, FSDP, DeepSpeed or the module itself), so the
    hooks a wrapper puts around a forward (gradient sync, parameter gathering) run around the fused loss too."""
    previous = module.__dict__.get("forward")  # TRL's own fused-head forward, an instance attribute

    def forward(*unused: Any, **unused_kw: Any) -> Any:
        return step()

    module.forward = forward
    try:
        return wrapper()
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def fused_compute_loss(trainer: Any, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    """GRPOTrainer.compute_loss through osvl's fused loss: TRL 1.16's `_compute_loss` for the loss types osvl
    implements, with its normalisers and metrics. Bound to the trainer by `OsvlFusedLinearGRPOLoss.install`."""
    if return_outputs:
        raise ValueError("The GRPOTrainer does not support returning outputs")
    unwrapped = trainer.accelerator.unwrap_model(model)
    loss, stats = through_forward(model, unwrapped, lambda: _fused_step(trainer, causal_lm(unwrapped), inputs))
    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    if trainer.loss_type == "dapo":
        # the module divides by num_items_in_batch / processes; TRL's window is `accumulation` of `steps_per_generation`
        loss = loss * (trainer.args.steps_per_generation / accumulation if mode == "train" else 1.0)
    else:
        loss = loss / accumulation
    totals = trainer.accelerator.reduce(stats, reduction="sum")
    means = (totals[:, 0] / totals[:, 1].clamp(min=1.0)).tolist()
    names = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"]
    for name, value in zip(names, means):
        trainer._metrics[mode][name].append(value)
    return loss


def _fused_step(trainer: Any, model: Any, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss (before TRL's accumulation normaliser) and [metric, (sum, count)] rows of TRL's masked means."""
    completion_ids = inputs["completion_ids"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    extra = {key: inputs[key] for key in MODEL_INPUT_KEYS if inputs.get(key) is not None}
    with trainer.accelerator.autocast():
        backbone = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        # position t's hidden state scores token t + 1: the completion is scored by the L positions before its tokens
        hidden = backbone.last_hidden_state[:, -completion_ids.shape[1] - 1 : -1]
        # The head's dtype as TRL's fused head picks it: fp32 with cast_lm_head_to_fp32, else autocast's (bf16 by
        # GRPOConfig's default, on CPU too), else the hidden states'.
        dtype = hidden.dtype
        if trainer.args.cast_lm_head_to_fp32:
            dtype = torch.float32
        elif torch.is_autocast_enabled(hidden.device.type):
            dtype = torch.get_autocast_dtype(hidden.device.type)
    vllm_ratio = None
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        vllm_ratio = inputs["importance_sampling_ratio"]
    loss_fn = trainer.osvl_loss
    out, layout, old, ref = loss_fn.packed_loss(
        _input=hidden.to(dtype),
        lin_weight=model.get_output_embeddings().weight.to(dtype),
        selected_token_ids=completion_ids,
        attention_mask=mask,
        advantages=inputs["advantages"],
        old_per_token_logps=inputs.get("old_per_token_logps"),
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        vllm_is_ratio=vllm_ratio,
        num_items_in_batch=inputs.get("num_items_in_batch"),
    )
    count = torch.tensor(float(out.logprobs.shape[0]), device=out.logprobs.device)
    low, high = loss_fn.clipped(out.logprobs, old, inputs["advantages"], layout.cu_seqlens)
    rows = [out.metrics["entropy_mean"] * count, low.float().sum(), high.float().sum(), (low | high).float().sum()]
    if ref is not None:
        with torch.no_grad():
            log_ratio = ref - out.logprobs
            kl = torch.exp(log_ratio) - log_ratio - 1
            if loss_fn.use_bias_correction_kl and old is not None:
                kl = kl * torch.exp(out.logprobs - old)
        rows.append(kl.sum())
    return out.loss, torch.stack([torch.stack([row.float(), count]) for row in rows])
