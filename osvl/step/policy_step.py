"""One policy step, written once: the packed forward, the loss from one frozen config, the optimizer step.

SFT, GRPO, the old-policy recompute, the serving pre-flight probe and bench/train_step.py call these and
nothing else for a step, so a benchmark times the step the trainer runs and a change to the step
reaches every caller. The GRPO loss's settings are built once per stage from the recipe
(:func:`grpo_loss_config`); the value checks that need a host transfer stay off on the hot path
(the packer built the batch) unless ``grpo.check_loss_inputs`` asks for them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torchtitan.distributed.utils import clip_grad_norm_

from osvl.config.recipe import GRPOConfig, OptimizerConfig
from osvl.data.packing import PackedBatch
from osvl.parallel import lm_head_weight
from osvl.step.sft_loss import sft_loss
from osvl_kernels import GRPOLossConfig, GRPOLossOutput, RolloutCorrection, linear_grpo_loss, linear_token_logprobs


class NonFiniteGradient(RuntimeError):
    """A step's global gradient norm was inf or nan and ``optimizer.on_nonfinite = "stop"``."""


def loss_backend(device: torch.device) -> str:
    """Triton where it is compiled (CUDA); the torch backend elsewhere, where Triton would only run in
    its interpreter (which the tests switch on for the kernels, not for whole training steps)."""
    return "auto" if device.type == "cuda" else "torch"


def rollout_correction(config: GRPOConfig) -> RolloutCorrection | None:
    """The recipe's trainer/engine correction for the fused loss; None when ``grpo.rollout_correction = "off"``."""
    if config.rollout_correction == "off":
        return None
    return RolloutCorrection(
        level=config.rollout_correction, mode=config.rollout_correction_mode, high=config.rollout_correction_cap
    )


def grpo_loss_config(config: GRPOConfig) -> GRPOLossConfig:
    """The GRPO stage's loss settings, once: the clip range, KL and entropy terms, temperature, aggregation,
    rollout correction, and whether to run the host-side value checks (the backend follows each call's
    device: :func:`with_backend`)."""
    return GRPOLossConfig(
        eps_low=config.eps_low,
        eps_high=config.eps_high,
        kl_coef=config.kl_coef,
        entropy_coef=config.entropy_coef,
        temperature=config.temperature,
        loss_agg=config.loss_agg,
        max_response_len=config.max_response_tokens,
        rollout_correction=rollout_correction(config),
        validate=config.check_loss_inputs,
    )


def packed_forward(model: torch.nn.Module, batch: PackedBatch) -> tuple[PackedBatch, torch.Tensor]:
    """The batch on the device the model's shards live on (it is packed on the host) and the final hidden
    states [T, H] of the packed multimodal forward."""
    batch = batch.to(next(model.parameters()).device)
    hidden = model(
        batch.input_ids,
        cu_seqlens=batch.cu_seqlens,
        position_ids=batch.position_ids,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
        return_hidden=True,
    )
    return batch, hidden


def grpo_loss_on_hidden(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    batch: PackedBatch,
    config: GRPOLossConfig,
    *,
    chunk_size: int | None,
    old_logprobs: torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    num_tokens: int | torch.Tensor | None = None,
) -> GRPOLossOutput:
    """The fused lm_head + fatal-aware GRPO loss of a device-side batch. The PPO ratio is taken against
    ``old_logprobs`` (the trainer's recompute) when given, else against the engine's ``batch.old_logprobs``;
    with a rollout correction in ``config`` the engine's log-probs are the behaviour policy."""
    old = batch.old_logprobs if old_logprobs is None else old_logprobs
    return linear_grpo_loss(
        hidden,
        lm_head_weight(model),
        batch.target_ids,
        batch.cu_seqlens,
        batch.loss_mask,
        old_logprobs=old,
        behavior_logprobs=None if config.rollout_correction is None else batch.old_logprobs,
        fatal_step=batch.fatal_step,
        token_step=batch.token_step,
        advantages=batch.advantages,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        chunk_size=chunk_size,
        config=with_backend(config, hidden.device),
    )


def sft_forward_loss(model: torch.nn.Module, batch: PackedBatch, normalizer: int, chunk: int) -> torch.Tensor:
    """One SFT micro-batch up to its backward: the masked next-token loss over ``normalizer`` tokens."""
    batch, hidden = packed_forward(model, batch)
    return sft_loss(hidden, lm_head_weight(model), batch.target_ids, batch.loss_mask, normalizer, chunk)


@torch.no_grad()
def policy_logprobs(
    model: torch.nn.Module, batch: PackedBatch, temperature: float, chunk_size: int | None = None
) -> torch.Tensor:
    """fp32 log-probs [T] of the batch's targets under the model's current weights, 0 off the loss mask
    (collective under FSDP: every rank calls it the same number of times)."""
    batch, hidden = packed_forward(model, batch)
    logprobs = linear_token_logprobs(
        hidden,
        lm_head_weight(model),
        batch.target_ids,
        temperature=temperature,
        chunk_size=chunk_size,
        backend=loss_backend(hidden.device),
        validate=False,
    )
    return torch.where(batch.loss_mask, logprobs, torch.zeros_like(logprobs))


@dataclass(frozen=True)
class OptimStep:
    grad_norm: torch.Tensor  # the global norm before clipping (the same on every rank)
    skipped: bool  # non-finite: the update was not applied


def optim_step(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: OptimizerConfig,
) -> OptimStep:
    """Clip to ``config.grad_clip``, then step, unless the global norm is inf or nan: then ``on_nonfinite``
    decides, "skip" (drop the gradients, keep the weights) or "stop" (:class:`NonFiniteGradient`). The
    norm is reduced over every rank, so all ranks decide alike; reading it is the step's one host sync.
    The schedule advances either way: its clock is the step count, not the updates applied."""
    grad_norm = clip_grad_norm_(list(params), config.grad_clip or math.inf)
    finite = bool(torch.isfinite(grad_norm))
    if not finite and config.on_nonfinite == "stop":
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradient(
            f"the global gradient norm is {float(grad_norm)} (a non-finite loss or gradient): stopped before the "
            f'update; optimizer.on_nonfinite = "skip" drops such updates and counts them instead'
        )
    if finite:
        optimizer.step()
        scheduler.step()
    else:
        with warnings.catch_warnings():  # a skipped first update: the schedule still moves on, on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return OptimStep(grad_norm=grad_norm, skipped=not finite)


def with_backend(config: GRPOLossConfig, device: torch.device) -> GRPOLossConfig:
    """``config`` with the backend for ``device`` (:func:`loss_backend`): the hidden states' device decides,
    which under CPU offload is not where the parameters live."""
    backend = loss_backend(device)
    return config if config.backend == backend else replace(config, backend=backend)
