"""One policy step (forward, loss, optimizer step), shared by both stages, the pre-flight probe and the
step benchmark; below rollout/, serve/ and trainer/, which all call it."""

from osvl.step.policy_step import (
    NonFiniteGradient,
    OptimStep,
    grpo_loss_config,
    grpo_loss_on_hidden,
    loss_backend,
    optim_step,
    packed_forward,
    policy_logprobs,
    rollout_correction,
    sft_forward_loss,
    with_backend,
)
from osvl.step.sft_loss import sft_loss

__all__ = [
    "NonFiniteGradient",
    "OptimStep",
    "grpo_loss_config",
    "grpo_loss_on_hidden",
    "loss_backend",
    "optim_step",
    "packed_forward",
    "policy_logprobs",
    "rollout_correction",
    "sft_forward_loss",
    "sft_loss",
    "with_backend",
]
