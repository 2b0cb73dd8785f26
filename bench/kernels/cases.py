"""The benchmarked implementations, each wrapped as a forward+backward `step` on one workload.

A case builds its own inputs in the layout its library expects (packed, padded [B, L+1, V], one
row per token), so only the step itself is timed and the inputs count as the memory baseline.
A missing library or device raises `Unavailable`; the harness records it and carries on.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.kernels.workload import EPS_HIGH, EPS_LOW, Workload, ppo_clip_token_loss, to_padded


class Unavailable(Exception):
    """The case cannot run here (library not installed, needs CUDA, ...)."""


@dataclass(frozen=True)
class CaseOptions:
    osvl_backend: str = "auto"  # backend= argument of the osvl entry points
    inplace_grad: bool = False  # osvl inplace_grad / Liger inplace: the gradient overwrites the logits
    liger_compiled: bool = True  # LigerFusedLinearGRPOLoss(compiled=...) (its default)
    liger_chunk_size: int = 1  # LigerFusedLinearGRPOLoss(chunk_size=...): sequences per chunk (its default)
    compile_backend: str = "inductor"  # torch.compile(backend=...) of the torch_compile case
    osvl_fp32_weight_grad: bool = False  # linear_grpo_loss(grad_weight_accum_dtype=torch.float32)


@dataclass
class Case:
    """`step()` runs forward+backward and returns the detached loss; `reset()` runs untimed before it."""

    step: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    pristine: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (leaf, saved copy)

    def reset(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None
        with torch.no_grad():
            for leaf, saved in self.pristine:
                leaf.copy_(saved)


def token_advantages(workload: Workload) -> torch.Tensor:
    return torch.repeat_interleave(
        workload.advantages, torch.tensor(workload.lengths, device=workload.advantages.device)
    )


def materialized_loss(logits: torch.Tensor, target_ids, old_logprobs, advantage, weight) -> torch.Tensor:
    """The naive baseline: fp32 log_softmax over the whole [T, V] under autograd."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, target_ids[:, None]).squeeze(1)
    return (ppo_clip_token_loss(logp, old_logprobs, advantage) * weight).sum()


def logits_leaf(workload: Workload, options: CaseOptions, layout: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """The logits input (optionally re-laid out) and, under in-place gradients, a copy to restore."""
    with torch.no_grad():
        logits = workload.logits()
        if layout is not None:
            logits = layout(logits)
    logits = logits.contiguous().requires_grad_()
    pristine = [(logits, logits.detach().clone())] if options.inplace_grad else []
    return logits, pristine


def supported_kwargs(fn: Callable, **kwargs) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def osvl_grpo_loss(workload: Workload, options: CaseOptions) -> Case:
    from osvl_kernels import grpo_loss

    logits, pristine = logits_leaf(workload, options)

    def step() -> torch.Tensor:
        out = grpo_loss(
            logits,
            workload.target_ids,
            workload.cu_seqlens,
            workload.loss_mask,
            old_logprobs=workload.old_logprobs,
            advantages=workload.advantages,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            loss_agg="seq-mean-token-mean",
            inplace_grad=options.inplace_grad,
            backend=options.osvl_backend,
            validate=False,
        )
        out.loss.backward()
        return out.loss.detach()

    return Case(step, [logits], pristine)


def osvl_linear_grpo_loss(workload: Workload, options: CaseOptions) -> Case:
    try:
        from osvl_kernels import linear_grpo_loss
    except ImportError as error:
        raise Unavailable(f"osvl_kernels.linear_grpo_loss not importable ({error})") from error
    hidden = workload.hidden.clone().requires_grad_()
    weight = workload.weight.clone().requires_grad_()
    accum = torch.float32 if options.osvl_fp32_weight_grad else None
    extra = supported_kwargs(
        linear_grpo_loss, backend=options.osvl_backend, validate=False, grad_weight_accum_dtype=accum
    )

    def step() -> torch.Tensor:
        out = linear_grpo_loss(
            hidden,
            weight,
            workload.target_ids,
            workload.cu_seqlens,
            workload.loss_mask,
            old_logprobs=workload.old_logprobs,
            advantages=workload.advantages,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            loss_agg="seq-mean-token-mean",
            **extra,
        )
        out.loss.backward()
        return out.loss.detach()

    return Case(step, [hidden, weight])


def require_liger_triton(device: torch.device) -> None:
    try:
        import liger_kernel  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"liger-kernel not installed ({error})") from error
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Unavailable("Liger's Triton kernels need CUDA, or TRITON_INTERPRET=1 on CPU")


def liger_grpo_loss_padded(workload: Workload, options: CaseOptions) -> Case:
    """Liger's Triton GRPO loss as TRL users run it: [B, L+1, V] padded logits, loss_type='grpo'."""
    require_liger_triton(workload.hidden.device)
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    logits, pristine = logits_leaf(workload, options, lambda x: to_padded(workload, x, extra_row=True))
    ids = to_padded(workload, workload.target_ids).contiguous()
    mask = to_padded(workload, workload.loss_mask.int()).contiguous()
    old = to_padded(workload, workload.old_logprobs).contiguous()

    def step() -> torch.Tensor:
        loss, _ = triton_grpo_loss(
            logits,
            old,
            None,
            ids,
            workload.advantages,
            mask,
            temperature=1.0,
            beta=0.0,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            inplace=options.inplace_grad,
            loss_type="grpo",
            reduce=True,
        )
        loss.backward()
        return loss.detach()

    return Case(step, [logits], pristine)


def liger_grpo_loss_same_rows(workload: Workload, options: CaseOptions) -> Case:
    """Liger's Triton GRPO loss on exactly our T rows (one row per token, B=T, L=1): kernel vs kernel."""
    require_liger_triton(workload.hidden.device)
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    def one_row_per_token(x: torch.Tensor) -> torch.Tensor:
        rows = x.new_zeros(x.shape[0], 2, x.shape[1])  # Liger reads rows [:, :L] of [B, L+1, V]
        rows[:, 0] = x
        return rows

    logits, pristine = logits_leaf(workload, options, one_row_per_token)
    ids = workload.target_ids[:, None].contiguous()
    mask = workload.loss_mask.int()[:, None].contiguous()
    old = workload.old_logprobs[:, None].contiguous()
    advantage = token_advantages(workload).contiguous()

    def step() -> torch.Tensor:
        per_token, _, _ = triton_grpo_loss(
            logits,
            old,
            None,
            ids,
            advantage,
            mask,
            temperature=1.0,
            beta=0.0,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            inplace=options.inplace_grad,
            loss_type="grpo",
            reduce=False,
        )
        loss = (per_token[:, 0] * workload.token_weight).sum()
        loss.backward()
        return loss.detach()

    return Case(step, [logits], pristine)


def liger_fused_linear_grpo(workload: Workload, options: CaseOptions) -> Case:
    """LigerFusedLinearGRPOLoss on padded [B, L, H] hidden states, chunked over sequences."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as error:
        raise Unavailable(f"liger-kernel not installed ({error})") from error
    hidden = to_padded(workload, workload.hidden).requires_grad_()
    weight = workload.weight.clone().requires_grad_()
    ids = to_padded(workload, workload.target_ids)
    mask = to_padded(workload, workload.loss_mask.int())
    old = to_padded(workload, workload.old_logprobs)
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0,
        compiled=options.liger_compiled,
        use_ref_model=False,
        chunk_size=options.liger_chunk_size,
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        loss_type="grpo",
        temperature=1.0,
    )

    def step() -> torch.Tensor:
        loss, _ = loss_fn(hidden, weight, ids, mask, workload.advantages, old_per_token_logps=old)
        loss.backward()
        return loss.detach()

    return Case(step, [hidden, weight])


def torch_eager(workload: Workload, options: CaseOptions, compiled: bool = False) -> Case:
    logits, _ = logits_leaf(workload, CaseOptions())
    advantage = token_advantages(workload)
    loss_fn = torch.compile(materialized_loss, backend=options.compile_backend) if compiled else materialized_loss

    def step() -> torch.Tensor:
        loss = loss_fn(logits, workload.target_ids, workload.old_logprobs, advantage, workload.token_weight)
        loss.backward()
        return loss.detach()

    return Case(step, [logits])


def torch_compile(workload: Workload, options: CaseOptions) -> Case:
    return torch_eager(workload, options, compiled=True)


def torch_eager_linear(workload: Workload, options: CaseOptions) -> Case:
    """The naive fused-linear baseline: the [T, V] logits and their fp32 log_softmax under autograd."""
    hidden = workload.hidden.clone().requires_grad_()
    weight = workload.weight.clone().requires_grad_()
    advantage = token_advantages(workload)

    def step() -> torch.Tensor:
        logits = hidden @ weight.T
        loss = materialized_loss(logits, workload.target_ids, workload.old_logprobs, advantage, workload.token_weight)
        loss.backward()
        return loss.detach()

    return Case(step, [hidden, weight])


# name -> (kind, builder). "logits": input is [T, V] logits; "linear": input is hidden [T, H] + lm_head.
CASES: dict[str, tuple[str, Callable[[Workload, CaseOptions], Case]]] = {
    "osvl_grpo_loss": ("logits", osvl_grpo_loss),
    "liger_grpo_loss_padded": ("logits", liger_grpo_loss_padded),
    "liger_grpo_loss_same_rows": ("logits", liger_grpo_loss_same_rows),
    "torch_eager": ("logits", torch_eager),
    "torch_compile": ("logits", torch_compile),
    "osvl_linear_grpo_loss": ("linear", osvl_linear_grpo_loss),
    "liger_fused_linear_grpo": ("linear", liger_fused_linear_grpo),
    "torch_eager_linear": ("linear", torch_eager_linear),
}


def build_case(name: str, workload: Workload, options: CaseOptions) -> Case:
    if name not in CASES:
        raise ValueError(f"unknown case {name!r}; expected one of {sorted(CASES)}")
    return CASES[name][1](workload, options)
