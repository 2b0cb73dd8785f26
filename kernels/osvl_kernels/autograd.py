"""Attaching gradients that were computed in the forward pass to a loss value.

The fused passes already know d(loss)/d(input) when they return the loss, so backward only
scales the stored gradients by the incoming scalar. Stored buffers are ours (never user
tensors, except logits under `inplace_grad`), so they are scaled in place.
"""

from __future__ import annotations

import torch


class _LossWithPrecomputedGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, num_inputs: int, *inputs_then_grads: torch.Tensor) -> torch.Tensor:
        ctx.grads = inputs_then_grads[num_inputs:]
        ctx.num_inputs = num_inputs
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.grads]
        ctx.grads = ()
        return (None, None, *grads, *([None] * ctx.num_inputs))


def loss_with_grads(
    loss: torch.Tensor, inputs: list[torch.Tensor], grads: list[torch.Tensor | None]
) -> torch.Tensor:
    """Returns `loss` (detached value) whose backward yields grads[i] * grad_loss for inputs[i].

    A grad of None means the input does not require a gradient.
    """
    if len(inputs) != len(grads):
        raise ValueError("inputs and grads must pair up")
    return _LossWithPrecomputedGrads.apply(loss, len(inputs), *inputs, *grads)
