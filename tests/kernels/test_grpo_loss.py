"""grpo_loss against the float64 reference: loss, logits gradient, log-probs, advantages, metrics."""

from __future__ import annotations

import pytest
import torch

from osvl_kernels import grpo_loss
from osvl_kernels.grpo_loss import grpo_loss_output
from osvl_kernels.inputs import LossPlan
from osvl_kernels.reference import reference_grpo_loss
from osvl_kernels.token_results import TokenPassResult
from tests.kernels.packed import random_packed_batch

BACKENDS = ["torch", "triton"]
AGGS = ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean", "seq-mean-token-sum-norm", "token-sum"]
LOSS_KEYS = (
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


def run_both(batch: dict, backend: str, **kwargs):
    logits = batch["logits"].clone().requires_grad_()
    inputs = {k: batch[k] for k in LOSS_KEYS}
    inputs.update(kwargs.pop("override", {}))
    out = grpo_loss(logits, **inputs, backend=backend, **kwargs)
    out.loss.backward()
    ref_logits = batch["logits"].double().requires_grad_()
    ref_loss, ref_logp, ref_adv = reference_grpo_loss(ref_logits, **inputs, **kwargs)
    if ref_loss.requires_grad:
        ref_loss.backward()
    ref_grad = ref_logits.grad if ref_logits.grad is not None else torch.zeros_like(ref_logits)
    return out, logits.grad, ref_loss, ref_grad, ref_logp, ref_adv


def assert_close(out, grad, ref_loss, ref_grad, ref_logp, ref_adv, tol=1e-5):
    torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)
    torch.testing.assert_close(out.logprobs.double(), ref_logp, rtol=tol, atol=tol)
    torch.testing.assert_close(out.advantages.double(), ref_adv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", AGGS)
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "drgrpo"])
def test_matches_reference_across_aggregations_and_estimators(backend, loss_agg, estimator):
    batch = random_packed_batch(seed=hash((loss_agg, estimator)) % 1000, vocab=67)
    got = run_both(batch, backend, loss_agg=loss_agg, estimator=estimator, max_response_len=12)
    assert_close(*got)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    [
        dict(dual_clip=3.0),
        dict(kl_coef=0.05),
        dict(entropy_coef=0.01),
        dict(temperature=0.7),
        dict(std="population", clamp_fatal=False),
        dict(dual_clip=2.0, kl_coef=0.1, entropy_coef=0.02, temperature=1.3, eps_low=0.1, eps_high=0.5),
    ],
    ids=["dual", "kl", "entropy", "temperature", "population-noclamp", "everything"],
)
def test_matches_reference_with_options(backend, options):
    batch = random_packed_batch(seed=7, vocab=128, num_seqs=8, group_size=4)
    assert_close(*run_both(batch, backend, **options))


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_policy_ratio_is_one_and_gradient_is_advantage_weighted(backend):
    batch = random_packed_batch(seed=3)
    got = run_both(batch, backend, override={"old_logprobs": None})
    assert_close(*got)
    out = got[0]
    assert out.metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert out.metrics["clip_frac"].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_precomputed_advantages_per_sequence_and_per_token(backend):
    batch = random_packed_batch(seed=11)
    S = batch["cu_seqlens"].numel() - 1
    T = batch["logits"].shape[0]
    for adv in (torch.randn(S), torch.randn(T)):
        override = {"rewards": None, "group_ids": None, "advantages": adv}
        out, *rest = run_both(batch, backend, override=override)
        assert_close(out, *rest)
        # No estimator and no clamp: the caller's values come back untouched.
        torch.testing.assert_close(out.advantages, adv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logits_fp32_math(backend):
    batch = random_packed_batch(seed=5, dtype=torch.bfloat16, vocab=100)
    out, grad, ref_loss, ref_grad, ref_logp, _ = run_both(batch, backend, kl_coef=0.1)
    assert grad.dtype == torch.bfloat16 and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logprobs.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequence_and_all_fatal_at_step_zero(backend):
    batch = random_packed_batch(seed=9, empty_seq=True)
    S = batch["cu_seqlens"].numel() - 1
    batch["fatal_step"] = torch.zeros(S, dtype=torch.int32)  # every trajectory fatal at step 0
    out, grad, ref_loss, *_ = run_both(batch, backend)
    assert out.metrics["num_valid_tokens"].item() == 0
    assert out.loss.item() == 0.0 and ref_loss.item() == 0.0
    assert torch.count_nonzero(grad) == 0
    assert out.metrics["num_fatal_seqs"].item() == S


@pytest.mark.parametrize("backend", BACKENDS)
def test_fatal_tokens_get_zero_gradient_and_clamp_is_counted(backend):
    batch = random_packed_batch(seed=21, fatal_frac=0.6, num_seqs=9)
    out, grad, *_ = run_both(batch, backend)
    cu = batch["cu_seqlens"].long()
    for i, f in enumerate(batch["fatal_step"].tolist()):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        masked = ~batch["loss_mask"][rows]
        if f >= 0:
            masked |= batch["token_step"][rows] >= f
        assert torch.count_nonzero(grad[rows][masked]) == 0
    fatal = batch["fatal_step"] >= 0
    assert out.metrics["num_fatal_seqs"].item() == int(fatal.sum())
    assert (out.advantages[fatal] >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_grad_overwrites_logits_with_the_gradient(backend):
    batch = random_packed_batch(seed=13)
    expected = run_both(batch, backend)[1]
    logits = batch["logits"].clone().requires_grad_()
    inputs = {k: batch[k] for k in LOSS_KEYS}
    out = grpo_loss(logits, **inputs, backend=backend, inplace_grad=True)
    out.loss.backward()
    torch.testing.assert_close(logits.grad, expected)
    assert logits.grad.data_ptr() == logits.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_scales_with_upstream_grad(backend):
    batch = random_packed_batch(seed=17)
    base = run_both(batch, backend)[1]
    logits = batch["logits"].clone().requires_grad_()
    out = grpo_loss(logits, **{k: batch[k] for k in LOSS_KEYS}, backend=backend)
    (out.loss * 2.5).backward()
    torch.testing.assert_close(logits.grad, base * 2.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_normalizers_override_local_counts(backend):
    batch = random_packed_batch(seed=19)
    inputs = {k: batch[k] for k in LOSS_KEYS}
    local = grpo_loss(batch["logits"], **inputs, backend=backend, loss_agg="token-mean")
    n = int(local.metrics["num_valid_tokens"])
    doubled = grpo_loss(batch["logits"], **inputs, backend=backend, loss_agg="token-mean", num_tokens=2 * n)
    torch.testing.assert_close(doubled.loss, local.loss / 2)
    S = batch["cu_seqlens"].numel() - 1
    seq = grpo_loss(batch["logits"], **inputs, backend=backend)
    seq_global = grpo_loss(batch["logits"], **inputs, backend=backend, num_seqs=4 * S)
    torch.testing.assert_close(seq_global.loss, seq.loss / 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_metrics_match_direct_computation(backend):
    batch = random_packed_batch(seed=23, num_seqs=8)
    out = run_both(batch, backend, kl_coef=0.1, dual_clip=3.0)[0]
    plan_valid = out.logprobs != 0
    logp = out.logprobs[plan_valid]
    old = batch["old_logprobs"][plan_valid]
    ratio = torch.exp(logp - old)
    assert out.metrics["num_valid_tokens"].item() == int(plan_valid.sum())
    torch.testing.assert_close(out.metrics["ratio_mean"], ratio.mean())
    torch.testing.assert_close(out.metrics["ratio_max"], ratio.max())
    torch.testing.assert_close(out.metrics["logprob_abs_diff_mean"], (logp - old).abs().mean())
    ref = batch["ref_logprobs"][plan_valid]
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(out.metrics["kl_mean"], kl.mean())
    assert 0.0 <= out.metrics["clip_frac"].item() <= 1.0


def test_logits_without_grad_give_a_plain_loss():
    batch = random_packed_batch(seed=29)
    out = grpo_loss(batch["logits"], **{k: batch[k] for k in LOSS_KEYS}, backend="torch")
    assert not out.loss.requires_grad
    assert torch.isfinite(out.loss)


def test_masked_vocab_entries_do_not_make_nans():
    """-inf logits (padded vocab) behave exactly like a vocab without those entries."""
    batch = random_packed_batch(seed=31, vocab=40)
    batch["target_ids"] = batch["target_ids"] % 30
    inputs = {k: batch[k] for k in LOSS_KEYS}
    padded = batch["logits"].clone()
    padded[:, 30:] = float("-inf")
    padded.requires_grad_()
    out = grpo_loss(padded, **inputs, backend="torch", entropy_coef=0.05)
    out.loss.backward()
    trimmed = batch["logits"][:, :30].clone().requires_grad_()
    expected = grpo_loss(trimmed, **inputs, backend="torch", entropy_coef=0.05)
    expected.loss.backward()
    assert torch.isfinite(padded.grad).all()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(padded.grad[:, :30], trimmed.grad)
    assert torch.count_nonzero(padded.grad[:, 30:]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_without_tokens(backend):
    logits = torch.zeros(0, 11, requires_grad=True)
    empty_long = torch.zeros(0, dtype=torch.long)
    out = grpo_loss(
        logits,
        empty_long,
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(0, dtype=torch.bool),
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.zeros(2, dtype=torch.long),
        backend=backend,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and logits.grad.shape == (0, 11)
    assert out.metrics["num_valid_tokens"].item() == 0 and out.metrics["ratio_max"].item() == 0.0


def _pass_and_plan(weight: list[float]):
    w = torch.tensor(weight)
    valid = w > 0
    T = w.numel()
    result = TokenPassResult(
        logp=-torch.rand(T),
        entropy=torch.rand(T),
        loss=torch.randn(T),
        ratio=1 + 0.1 * torch.randn(T),
        clipped=torch.zeros(T, dtype=torch.bool),
        dual_clipped=torch.zeros(T, dtype=torch.bool),
        kl=torch.zeros(T),
    )
    plan = LossPlan(
        valid=valid,
        weight=w,
        token_advantage=torch.randn(T),
        advantages=torch.randn(2),
        is_fatal=torch.tensor([True, False]),
        clamped=torch.tensor([True, False]),
    )
    return result, plan


def test_grpo_loss_output_weights_the_objective_and_hands_out_the_stored_grads():
    torch.manual_seed(0)
    result, plan = _pass_and_plan([0.5, 0.25, 0.0, 0.25])
    x, y = torch.randn(4, 3, requires_grad=True), torch.randn(2, 3)
    g = torch.randn(4, 3)
    out = grpo_loss_output(result, plan, None, [x, y], [g.clone(), None])
    expected = (result.loss.double() * plan.weight.double()).sum()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-7)
    (3.0 * out.loss).backward()
    torch.testing.assert_close(x.grad, 3.0 * g)
    assert y.grad is None
    assert out.logprobs is result.logp and out.advantages is plan.advantages
    assert int(out.metrics["num_valid_tokens"]) == 3 and int(out.metrics["num_clamped_seqs"]) == 1
    assert float(out.metrics["logprob_abs_diff_mean"]) == 0.0


def test_grpo_loss_output_without_grads_is_a_plain_value():
    result, plan = _pass_and_plan([1.0, 0.0])
    old = result.logp - 0.5
    out = grpo_loss_output(result, plan, old, [torch.randn(2, 3)], [None])
    assert not out.loss.requires_grad
    torch.testing.assert_close(out.loss, result.loss[0])
    torch.testing.assert_close(out.metrics["logprob_abs_diff_mean"], torch.tensor(0.5))
