"""Importance weights of the policy-gradient term (is_weights, behaviour log-probs + RolloutCorrection)
and the KL shapes (kl_max, kl_is_weighted): loss and gradients of both backends and of the
fused-linear path against the float64 reference, the weights themselves against hand-computed
values, metrics, and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from osvl_kernels import grpo_loss, linear_grpo_loss
from osvl_kernels.importance import RolloutCorrection, rollout_is_weights
from osvl_kernels.reference import reference_grpo_loss
from tests.kernels.packed import random_packed_batch

BACKENDS = ["torch", "triton"]
KEYS = (
    "target_ids",
    "cu_seqlens",
    "loss_mask",
    "old_logprobs",
    "rewards",
    "group_ids",
    "fatal_step",
    "token_step",
    "ref_logprobs",
)


def batch_with_behavior(seed: int) -> dict:
    b = random_packed_batch(seed=seed, vocab=53, num_seqs=8, group_size=4, max_len=7)
    g = torch.Generator().manual_seed(seed + 100)
    T = b["logits"].shape[0]
    b["behavior_logprobs"] = b["old_logprobs"] + torch.randn(T, generator=g) * 0.6
    b["is_weights"] = torch.rand(T, generator=g) * 2.5
    b["is_weights"][::5] = 0.0  # masked-out tokens (MIS) keep their KL and entropy terms
    return b


def run(b: dict, backend: str, override: dict | None = None, **kwargs):
    inputs = {k: b[k] for k in KEYS} | (override or {})
    logits = b["logits"].clone().requires_grad_()
    out = grpo_loss(logits, **inputs, backend=backend, **kwargs)
    out.loss.backward()
    ref_logits = b["logits"].double().requires_grad_()
    ref_loss, _, _ = reference_grpo_loss(ref_logits, **inputs, **kwargs)
    ref_loss.backward()
    torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-5)
    return out, logits.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_weights_scale_only_the_policy_gradient_term(backend):
    b = batch_with_behavior(1)
    opts = dict(kl_coef=0.1, entropy_coef=0.02, dual_clip=3.0)
    out, grad = run(b, backend, is_weights=b["is_weights"], **opts)
    _, plain = run(b, backend, **opts)
    assert not torch.allclose(grad, plain)  # the weights did change the gradient
    # With the policy-gradient term switched off everywhere, only KL and entropy remain: the
    # weights must then change nothing.
    zero_adv = {"rewards": torch.zeros_like(b["rewards"])}
    _, kl_only = run(b, backend, override=zero_adv, is_weights=b["is_weights"], **opts)
    _, kl_only_plain = run(b, backend, override=zero_adv, **opts)
    torch.testing.assert_close(kl_only, kl_only_plain)
    valid = out.metrics["num_valid_tokens"].item()
    assert valid > 0
    # The metric is the weights' mean over the valid tokens (the fatal cut and the loss mask apply).
    assert 0.0 < out.metrics["is_weight_mean"].item() < 2.5
    assert out.metrics["is_capped_frac"].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_correction_matches_reference(backend, level, mode):
    b = batch_with_behavior(2)
    correction = RolloutCorrection(level=level, mode=mode, high=1.6, low=0.5 if mode == "mask" else None)
    out, _ = run(b, backend, behavior_logprobs=b["behavior_logprobs"], rollout_correction=correction, kl_coef=0.05)
    assert 0.0 < out.metrics["is_capped_frac"].item() < 1.0  # some weights were capped, some not


def test_linear_grpo_loss_takes_the_same_weights():
    b = batch_with_behavior(3)
    inputs = {k: b[k] for k in KEYS}
    correction = RolloutCorrection(level="token", high=1.3)
    h = b["hidden"].clone().requires_grad_()
    w = b["weight"].clone().requires_grad_()
    out = linear_grpo_loss(
        h,
        w,
        **inputs,
        behavior_logprobs=b["behavior_logprobs"],
        rollout_correction=correction,
        kl_coef=0.1,
        kl_max=0.8,
        kl_is_weighted=True,
        backend="torch",
        chunk_size=5,
    )
    out.loss.backward()
    h64, w64 = b["hidden"].double().requires_grad_(), b["weight"].double().requires_grad_()
    ref, _, _ = reference_grpo_loss(
        h64 @ w64.T,
        **inputs,
        behavior_logprobs=b["behavior_logprobs"],
        rollout_correction=correction,
        kl_coef=0.1,
        kl_max=0.8,
        kl_is_weighted=True,
    )
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("on_policy", [False, True])
def test_kl_clamp_and_ratio_weighted_kl(backend, on_policy):
    b = batch_with_behavior(4)
    override = {"old_logprobs": None} if on_policy else {}
    logp = torch.log_softmax(b["logits"].double(), -1).gather(1, b["target_ids"][:, None]).squeeze(1)
    delta = b["ref_logprobs"].double() - logp
    k3 = delta.exp() - delta - 1
    assert (k3 > 0.6).any() and (k3 < 0.6).any()  # the clamp is active on some tokens only
    clamped, _ = run(b, backend, override=override, kl_coef=0.2, kl_max=0.6)
    run(b, backend, override=override, kl_coef=0.2, kl_is_weighted=True)
    run(b, backend, override=override, kl_coef=0.2, kl_max=0.6, kl_is_weighted=True)
    assert clamped.metrics["kl_mean"].item() <= 0.6


def test_kl_clamp_cuts_the_kl_gradient():
    """A token whose k3 exceeds kl_max contributes kl_max and no KL gradient (verl's clamp)."""
    logits = torch.tensor([[2.0, -1.0, 0.5]], requires_grad=True)
    args = dict(
        target_ids=torch.tensor([1]),
        cu_seqlens=torch.tensor([0, 1]),
        loss_mask=torch.tensor([True]),
        advantages=torch.zeros(1),
        ref_logprobs=torch.tensor([-0.01]),
        kl_coef=1.0,
    )
    out = grpo_loss(logits, **args, kl_max=1.0, backend="torch")
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.0)
    assert torch.count_nonzero(logits.grad) == 0
    free = grpo_loss(logits.detach().clone().requires_grad_(), **args, backend="torch")
    assert free.loss.item() > 1.0


def test_rollout_is_weights_by_hand():
    old = torch.tensor([0.0, -1.0, -2.0, -0.5, -3.0, float("nan")])
    behavior = torch.tensor([-1.0, -1.0, -0.5, -0.5, -2.0, -1.0])
    valid = torch.tensor([True, True, True, False, True, True])
    seq_id = torch.tensor([0, 0, 0, 1, 1, 1])
    e = math.e
    w, capped = rollout_is_weights(old, behavior, valid, seq_id, 2, RolloutCorrection("token", "truncate", high=2.0))
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0, math.exp(-1.5), 1.0, 1 / e, 1.0]))
    assert capped.tolist() == [True, False, False, False, False, False]
    w, capped = rollout_is_weights(old, behavior, valid, seq_id, 2, RolloutCorrection("token", "mask", 2.0, 0.3))
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 0.0, 1.0, 1 / e, 1.0]))
    assert capped.tolist() == [True, False, True, False, False, False]
    # Sequence 0: log-ratio 1 + 0 - 1.5 = -0.5; sequence 1 (token 3 invalid, token 5 NaN -> 0): -1.
    w, capped = rollout_is_weights(old, behavior, valid, seq_id, 2, RolloutCorrection("sequence", "truncate", 2.0))
    torch.testing.assert_close(w, torch.tensor([math.exp(-0.5)] * 3 + [1.0, 1 / e, 1 / e]))
    assert not capped.any()
    w, capped = rollout_is_weights(old, behavior, valid, seq_id, 2, RolloutCorrection("sequence", "mask", 2.0, 0.5))
    torch.testing.assert_close(w, torch.tensor([math.exp(-0.5)] * 3 + [1.0, 0.0, 0.0]))
    assert capped.tolist() == [False, False, False, False, True, True]


def test_bad_importance_inputs_raise_value_error():
    b = batch_with_behavior(5)
    inputs = {k: b[k] for k in KEYS}
    logits = b["logits"]
    T = logits.shape[0]
    cases = [
        (
            dict(
                is_weights=b["is_weights"],
                behavior_logprobs=b["behavior_logprobs"],
                rollout_correction=RolloutCorrection(),
            ),
            "either is_weights or behavior_logprobs",
        ),
        (dict(behavior_logprobs=b["behavior_logprobs"]), "go together"),
        (dict(rollout_correction=RolloutCorrection()), "go together"),
        (dict(is_weights=torch.ones(T + 1)), r"is_weights must have shape"),
        (dict(is_weights=torch.ones(T, dtype=torch.long)), "is_weights must be a float"),
        (dict(is_weights=-b["is_weights"] - 1.0), "finite and >= 0"),
        (dict(behavior_logprobs=b["behavior_logprobs"], rollout_correction="token"), "must be a RolloutCorrection"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            grpo_loss(logits, **inputs, **kwargs)
    with pytest.raises(ValueError, match="needs old_logprobs"):
        grpo_loss(
            logits,
            **(inputs | {"old_logprobs": None}),
            behavior_logprobs=b["behavior_logprobs"],
            rollout_correction=RolloutCorrection(),
        )
    for kwargs, message in [
        (dict(level="geometric"), "level must be one of"),
        (dict(mode="clip"), "mode must be one of"),
        (dict(high=0.0), "high must be a finite number > 0"),
        (dict(high=float("inf")), "high must be a finite number > 0"),
        (dict(high=2.0, low=3.0), r"low must be None or in \[0, high"),
    ]:
        with pytest.raises(ValueError, match=message):
            RolloutCorrection(**kwargs)
    with pytest.raises(ValueError, match="kl_max must be"):
        grpo_loss(logits, **inputs, kl_coef=0.1, kl_max=0.0)
