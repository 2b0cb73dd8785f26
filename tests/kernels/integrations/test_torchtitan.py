"""The torchtitan adapter built from its Config and called as torchtitan 0.3.0's RL PolicyTrainer
calls its loss, compared with torchtitan's own DAPOLoss and with grpo_loss on the packed rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torchtitan

from osvl_kernels import grpo_loss
from osvl_kernels.integrations.torchtitan import OsvlGRPOLoss, packed_cu_seqlens


def torchtitan_dapo_loss_class():
    """torchtitan's DAPOLoss, loaded from its file: its package __init__ imports vLLM."""
    path = Path(torchtitan.__file__).parent / "experiments/rl/losses/dapo.py"
    spec = importlib.util.spec_from_file_location("torchtitan_rl_dapo", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module.DAPOLoss


def rl_microbatch(seed: int, B: int = 2, L: int = 8, V: int = 29) -> dict:
    """Two packed rows like torchtitan's Batcher builds them: samples back to back, positions
    restarting at 0 per sample, then padding."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.randn(B, L, generator=g)
    gen = -torch.rand(B, L, generator=g) * 3 - 1.0
    gen[1, 3] = float("-inf")  # vLLM under cudagraph: dropped from the loss
    return dict(
        logits=torch.randn(B, L, V, generator=g) * 2,
        labels=torch.randint(0, V, (B, L), generator=g),
        generator_logprobs=gen,
        advantages=torch.where(loss_mask, adv, torch.zeros_like(adv)),
        loss_mask=loss_mask,
        positions=positions,
    )


def call(loss_fn, batch: dict, gvt, **extra):
    logits = batch["logits"].clone().requires_grad_()
    loss, metrics = loss_fn(
        logits,
        batch["labels"],
        gvt,
        generator_logprobs=batch["generator_logprobs"],
        advantages=batch["advantages"],
        loss_mask=batch["loss_mask"],
        **extra,
    )
    loss.backward()
    return loss.detach(), metrics, logits.grad


def test_matches_torchtitan_dapo_loss():
    batch = rl_microbatch(0)
    gvt = torch.tensor(11.0)
    ours = OsvlGRPOLoss.Config(eps_low=0.2, eps_high=0.28).build()
    theirs = torchtitan_dapo_loss_class().Config(ratio_clip_low=0.2, ratio_clip_high=0.28).build()
    loss, metrics, grad = call(ours, batch, gvt, positions=batch["positions"])
    loss_ref, metrics_ref, grad_ref = call(theirs, batch, gvt)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-6)
    for key in ("loss/ratio_mean", "loss/ratio_clipped_frac"):
        torch.testing.assert_close(metrics[key], metrics_ref[key], rtol=1e-5, atol=1e-6)


def test_equals_grpo_loss_on_packed_sequences_with_dual_clip():
    batch = rl_microbatch(1)
    ours = OsvlGRPOLoss.Config(eps_low=0.1, eps_high=0.1, dual_clip=1.5).build()
    loss, _, grad = call(ours, batch, 7.0, positions=batch["positions"])
    valid = batch["loss_mask"] & torch.isfinite(batch["generator_logprobs"])
    logits = batch["logits"].reshape(16, -1).clone().requires_grad_()
    out = grpo_loss(
        logits,
        batch["labels"].reshape(-1),
        torch.tensor([0, 3, 7, 8, 13, 16], dtype=torch.int32),
        valid.reshape(-1),
        old_logprobs=torch.where(valid, batch["generator_logprobs"], 0.0).reshape(-1),
        advantages=batch["advantages"].reshape(-1),
        eps_low=0.1,
        eps_high=0.1,
        dual_clip=1.5,
        loss_agg="token-mean",
        num_tokens=7.0,
    )
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss.detach())
    torch.testing.assert_close(grad.reshape(16, -1), logits.grad)


def test_packed_cu_seqlens_splits_at_position_zero_and_row_starts():
    positions = torch.tensor([[0, 1, 0, 1, 2], [3, 4, 0, 1, 0]])
    assert packed_cu_seqlens((2, 5), positions, torch.device("cpu")).tolist() == [0, 2, 5, 7, 9, 10]
    assert packed_cu_seqlens((2, 5), None, torch.device("cpu")).tolist() == [0, 5, 10]


def test_bad_inputs_raise_value_error():
    batch = rl_microbatch(2)
    loss_fn = OsvlGRPOLoss.Config().build()
    with pytest.raises(ValueError, match="advantages must be"):
        call(loss_fn, {**batch, "advantages": batch["advantages"][:, :3]}, 5.0)
    with pytest.raises(ValueError, match=r"logits must be \[B, L, V\]"):
        loss_fn(
            batch["logits"][0],
            batch["labels"],
            5.0,
            generator_logprobs=batch["generator_logprobs"],
            advantages=batch["advantages"],
            loss_mask=batch["loss_mask"],
        )
    with pytest.raises(ValueError, match="positions must be"):
        call(loss_fn, batch, 5.0, positions=batch["positions"][:, :4])
    with pytest.raises(ValueError, match="eps_low"):
        call(OsvlGRPOLoss.Config(eps_low=1.5).build(), batch, 5.0)
