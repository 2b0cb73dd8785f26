"""The fp32 router and the MoE router losses: float64 references, transformers' definition, the
gradient injection, activation checkpointing, bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

from osvl.model import build_model
from osvl.model.moe_losses import AuxLossInjector, balance_loss, expert_counts, load_cv, z_loss_sum
from osvl.model.router import Qwen3VLRouter, RouterLossInputs
from tests.model.moe_reference import layer_terms, top_k_margin
from tests.model.tiny import tiny_config

E, K, D = 8, 2, 16


def _router(seed: int = 0, scale: float = 1.0) -> Qwen3VLRouter:
    torch.manual_seed(seed)
    model = build_model(tiny_config(moe=True))
    router = next(m for m in model.modules() if isinstance(m, Qwen3VLRouter))
    with torch.no_grad():
        router.gate.weight.mul_(scale)
    return router


def _inputs(routed: int, step: int, aux: float = 0.5, z: float = 0.1) -> RouterLossInputs:
    return RouterLossInputs(aux_coef=aux, z_coef=z, routed_tokens=routed, step_tokens=step)


def test_balance_loss_is_one_at_uniform_load_and_equals_the_switch_formula():
    counts = torch.full((E,), 3.0 * K)  # 24 tokens, 2 choices each, spread evenly
    uniform = torch.full((E,), 24 / E)
    assert float(balance_loss(uniform, counts, 24, K)) == pytest.approx(1.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, D, generator=gen, dtype=torch.float64)
    gate = torch.randn(E, D, generator=gen, dtype=torch.float64)
    probs = torch.softmax(x @ gate.t(), -1)
    ids = probs.topk(K, -1).indices
    ours = balance_loss(probs.sum(0), expert_counts(ids, torch.ones(24, dtype=torch.bool), E), 24, K)
    reference, _ = layer_terms(x, gate, K, 24)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-12, atol=0)
    two_experts = torch.zeros(E)
    two_experts[:K] = 24  # every token chose experts 0 and 1
    assert float(balance_loss(uniform, two_experts, 24, K)) == pytest.approx(1.0)  # uniform P: any load scores 1
    assert float(balance_loss(two_experts / K, two_experts, 24, K)) == pytest.approx(E / K)  # the maximum


def test_transformers_definition_is_top_k_times_one_layers_balance():
    """HF's load_balancing_loss_func (Qwen3-VL-MoE) has no 1/k and pools layers before the product."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(30, E, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    mask = torch.arange(30) < 22  # 8 padding tokens at the end, like our filler documents
    ids = probs.topk(K, -1).indices
    ours = balance_loss((probs * mask[:, None]).sum(0), expert_counts(ids, mask, E), 22, K)
    hf = load_balancing_loss_func((logits,), E, K, attention_mask=mask[None].long())
    torch.testing.assert_close(hf.double(), K * ours.double(), rtol=1e-6, atol=0)
    everyone = torch.ones(30, dtype=torch.bool)

    def ours_mean(*layers):
        probs = [torch.softmax(layer, -1) for layer in layers]
        return sum(
            float(balance_loss(p.sum(0), expert_counts(p.topk(K, -1).indices, everyone, E), 30, K)) for p in probs
        ) / len(layers)

    # pooled over layers: equal to k x the mean of the layers only when their loads agree
    assert float(load_balancing_loss_func((logits, logits.flip(0)), E, K)) == pytest.approx(
        K * ours_mean(logits, logits.flip(0)), rel=1e-6
    )
    first, second = logits.clone(), logits.clone()
    first[:, :2] += 5.0  # each layer overloads two experts, different ones: pooling hides it
    second[:, 2:4] += 5.0
    assert float(load_balancing_loss_func((first, second), E, K)) < 0.6 * K * ours_mean(first, second)


def test_load_cv_and_z_loss():
    assert load_cv(torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 0.0, 8.0, 0.0]])).tolist() == pytest.approx([0.0, 1.0])
    logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    mask = torch.tensor([True, False])
    assert float(z_loss_sum(logits, mask)) == pytest.approx(torch.log(torch.tensor(2.0)).item() ** 2)


def test_router_logits_are_fp32_for_bf16_inputs_and_weights():
    router = _router(scale=20.0).to(torch.bfloat16)
    x = torch.randn(1, 12, 32, dtype=torch.bfloat16)
    scores, ids, probs = router(x)
    assert probs.dtype == torch.float32 and scores.dtype == torch.bfloat16
    exact = torch.softmax(x.double() @ router.gate.weight.double().t(), -1).float()
    torch.testing.assert_close(probs, exact, rtol=1e-5, atol=1e-6)  # bf16 logits would miss by ~1e-3
    bf16 = torch.softmax((x @ router.gate.weight.t()).float(), -1)
    assert (bf16 - exact).abs().max() > 1e-4


def test_router_losses_and_gradient_equal_a_float64_reference():
    router = _router(scale=20.0).double()
    x = torch.randn(1, 20, 32, dtype=torch.float64, requires_grad=True)
    assert top_k_margin(x[0], router.gate.weight, K) > 1e-6
    routed, step = 17, 50  # three filler tokens at the end; the step has 50 real tokens over all ranks
    router.loss_inputs = _inputs(routed, step)
    scores, _, _ = router(x)
    scores.sum().backward()
    injected = (x.grad.clone(), router.gate.weight.grad.clone())

    x.grad, router.gate.weight.grad = None, None
    router.loss_inputs = None
    scores, _, _ = router(x)
    balance, z = layer_terms(x[0], router.gate.weight, K, routed)
    (scores.sum() + 0.5 * routed / step * balance + 0.1 * routed / step * z).backward()
    torch.testing.assert_close(injected[0], x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(injected[1], router.gate.weight.grad, rtol=1e-10, atol=1e-12)
    stats = _router_stats(router, x, routed, step)
    assert float(stats.balance) == pytest.approx(float(balance), rel=1e-12)
    assert float(stats.z_sum) == pytest.approx(float(z) * routed, rel=1e-12)
    assert stats.tokens == routed and float(stats.counts.sum()) == routed * K


def _router_stats(router, x, routed, step):
    router.loss_inputs = _inputs(routed, step)
    with torch.no_grad():
        router(x)
    return router.stats


def test_zero_coefficients_record_statistics_but_leave_the_gradient_alone():
    router = _router(scale=20.0)
    x = torch.randn(1, 9, 32, requires_grad=True)
    router.loss_inputs = _inputs(9, 9, aux=0.0, z=0.0)
    scores, _, _ = router(x)
    scores.sum().backward()
    with_stats = x.grad.clone()
    x.grad = None
    router.loss_inputs = None
    router(x)[0].sum().backward()
    torch.testing.assert_close(with_stats, x.grad, rtol=0, atol=0)
    assert router.stats is not None and router.stats.tokens == 9


def test_injected_gradient_survives_activation_checkpointing():
    router = _router(scale=20.0)
    x = torch.randn(1, 16, 32, requires_grad=True)
    router.loss_inputs = _inputs(16, 16)
    grads = []
    for wrap in (False, True):
        x.grad = None
        out = checkpoint(lambda t: router(t)[0], x, use_reentrant=False) if wrap else router(x)[0]
        out.square().sum().backward()
        grads.append(x.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)


def test_injector_adds_the_loss_gradient_and_returns_the_activation():
    activation = torch.randn(3, requires_grad=True)
    weight = torch.randn(3, requires_grad=True)
    out = AuxLossInjector.apply(activation, (weight**2).sum())
    torch.testing.assert_close(out, activation)
    (out * 2).sum().backward()
    torch.testing.assert_close(activation.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(weight.grad, 2 * weight)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(aux_coef=-1.0, z_coef=0.0, routed_tokens=1, step_tokens=1), "coefficients"),
        (dict(aux_coef=0.0, z_coef=0.0, routed_tokens=5, step_tokens=4), "routed_tokens"),
        (dict(aux_coef=0.0, z_coef=0.0, routed_tokens=0, step_tokens=0), "step_tokens"),
    ],
)
def test_bad_router_loss_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterLossInputs(**kwargs)


def test_router_refuses_more_routed_tokens_than_the_row_has():
    router = _router()
    router.loss_inputs = _inputs(30, 30)
    with pytest.raises(ValueError, match="exceeds"):
        router(torch.randn(1, 20, 32))
    with pytest.raises(ValueError, match="counts"):
        balance_loss(torch.ones(4), torch.ones(3), 4, 2)
