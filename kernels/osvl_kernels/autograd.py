"""Attaching gradients that were computed in the forward pass to a loss value.

The fused passes already know d(loss)/d(input) when they return the loss, so backward only
scales the stored gradients by the incoming scalar. Stored buffers are ours (never user
tensors, except logits under `inplace_grad`), so they are scaled in place; on the Triton backend
the scalar is read on the device and a scale of exactly 1 (plain `loss.backward()`) costs nothing.
"""

from __future__ import annotations

import torch

from osvl_kernels.token_pass import resolve_backend


def scale_grad_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad *= scale in place without a host sync."""
    on_triton = resolve_backend("auto", grad.device) == "triton"
    if on_triton and grad.is_contiguous() and grad.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from osvl_kernels.triton_token_pass import scale_triton_

        return scale_triton_(grad, scale)
    return grad.mul_(scale.to(grad.dtype))


class _LossWithPrecomputedGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, num_inputs: int, *inputs_then_grads: torch.Tensor) -> torch.Tensor:
        ctx.grads = inputs_then_grads[num_inputs:]
        ctx.num_inputs = num_inputs
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grads = [None if g is None else scale_grad_(g, grad_loss) for g in ctx.grads]
        ctx.grads = ()
        return (None, None, *grads, *([None] * ctx.num_inputs))


def loss_with_grads(loss: torch.Tensor, inputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Returns `loss` (detached value) whose backward yields grads[i] * grad_loss for inputs[i].

    A grad of None means the input does not require a gradient.
    """
    if len(inputs) != len(grads):
        raise ValueError("inputs and grads must pair up")
    return _LossWithPrecomputedGrads.apply(loss, len(inputs), *inputs, *grads)
