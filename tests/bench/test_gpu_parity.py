"""Correctness stage of bench/device_check.sh: the compiled kernels at benchmark scale
(V=151936, T=65536 packed tokens) against float64.

Each check is a function of the device and shape; the `gpu` tests run it at scale on CUDA, the
CPU tests run the same function at tiny shapes under the interpreter, so the checks cannot rot
on machines without a GPU.
"""

import pytest
import torch

from bench.kernels.cases import CaseOptions, build_case, materialized_loss, token_advantages
from bench.kernels.workload import Shape, make_workload, reference_loss
from osvl_kernels import grpo_loss
from osvl_kernels.reference import reference_grpo_loss
from tests.kernels.packed import random_packed_batch

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
ALL_TERMS = dict(dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01, temperature=0.9)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def check_full_semantics(device: str, vocab: int, num_seqs: int, max_len: int, dtype: torch.dtype) -> None:
    """Fatal mixes, every loss term, Triton backend: loss, log-probs and logits gradient vs float64."""
    batch = {
        k: v.to(device)
        for k, v in random_packed_batch(7, num_seqs=num_seqs, vocab=vocab, max_len=max_len, dtype=dtype).items()
    }
    inputs = {k: batch[k] for k in LOSS_KEYS}
    logits = batch["logits"].clone().requires_grad_()
    out = grpo_loss(logits, **inputs, backend="triton", **ALL_TERMS)
    out.loss.backward()
    ref_logits = batch["logits"].double().requires_grad_()
    ref_loss, ref_logp, ref_adv = reference_grpo_loss(ref_logits, **inputs, **ALL_TERMS)
    ref_loss.backward()
    torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.logprobs.double(), ref_logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.advantages.double(), ref_adv, rtol=1e-5, atol=1e-6)
    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2  # the gradient is stored in the logits dtype
    scale = ref_logits.grad.abs().max()
    torch.testing.assert_close(logits.grad.double() / scale, ref_logits.grad / scale, rtol=grad_tol, atol=grad_tol)


def check_large_batch(device: str, shape: Shape, sample_rows: int = 64) -> None:
    """The benchmark's own case at scale: loss vs chunked float64, sampled gradient rows vs float64."""
    workload = make_workload(shape, device, seed=3)
    case = build_case("osvl_grpo_loss", workload, CaseOptions(osvl_backend="triton"))
    case.reset()
    loss = float(case.step())
    assert loss == pytest.approx(reference_loss(workload), rel=1e-4, abs=1e-7)
    grad = case.leaves[0].grad
    assert torch.isfinite(grad).all()
    assert (grad[~workload.loss_mask] == 0).all()
    rows = torch.randperm(shape.num_tokens, generator=torch.Generator().manual_seed(0))[:sample_rows].to(device)
    sub = case.leaves[0].detach()[rows].double().requires_grad_()
    advantage = token_advantages(workload)[rows].double()
    materialized_loss(
        sub,
        workload.target_ids[rows],
        workload.old_logprobs[rows].double(),
        advantage,
        workload.token_weight[rows].double(),
    ).backward()
    scale = sub.grad.abs().max().clamp_min(1e-30)
    tol = 1e-5 if shape.dtype == "fp32" else 1e-2
    torch.testing.assert_close(grad[rows].double() / scale, sub.grad / scale, rtol=tol, atol=tol)


def check_linear(device: str, shape: Shape) -> None:
    """linear_grpo_loss (bench case) vs float64 autograd through hidden @ weight.T, the logits rounded to
    the input dtype as the kernel's contract says."""
    workload = make_workload(shape, device, seed=4)
    case = build_case("osvl_linear_grpo_loss", workload, CaseOptions(osvl_backend="triton"))
    case.reset()
    loss = float(case.step())
    hidden = workload.hidden.double().requires_grad_()
    weight = workload.weight.double().requires_grad_()
    logits = hidden @ weight.T
    # linear_grpo_loss's logits chunk is in the input dtype (the lm_head output an unfused trainer sees):
    # round the same way, gradient straight through, so that a token within a rounding error of a clip
    # boundary is clipped on both sides (against unrounded logits 2 of 4096 bf16 rows flipped on an H200)
    logits = logits + (logits.to(workload.weight.dtype).double() - logits).detach()
    ref = materialized_loss(
        logits,
        workload.target_ids,
        workload.old_logprobs.double(),
        token_advantages(workload).double(),
        workload.token_weight.double(),
    )
    ref.backward()
    tol = 1e-4 if shape.dtype == "fp32" else 2e-2
    assert loss == pytest.approx(float(ref.detach()), rel=tol, abs=1e-6)
    for got, want in zip(case.leaves, (hidden, weight)):
        scale = want.grad.abs().max()
        torch.testing.assert_close(got.grad.double() / scale, want.grad / scale, rtol=tol, atol=tol)


def test_full_semantics_cpu_interpreter():
    check_full_semantics("cpu", vocab=131, num_seqs=4, max_len=6, dtype=torch.float32)


def test_large_batch_cpu_interpreter():
    check_large_batch("cpu", Shape(num_tokens=40, vocab=97, hidden=8, num_seqs=3, dtype="fp32"), sample_rows=8)


def test_linear_cpu_interpreter():
    check_linear("cpu", Shape(num_tokens=24, vocab=53, hidden=8, num_seqs=3, dtype="fp32"))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_semantics_cuda_qwen_vocab(dtype):
    check_full_semantics("cuda", vocab=151936, num_seqs=24, max_len=96, dtype=dtype)


@pytest.mark.gpu
@requires_cuda
def test_large_batch_cuda_65536_tokens():
    check_large_batch("cuda", Shape(num_tokens=65536, vocab=151936, hidden=256, num_seqs=64, dtype="bf16"))


@pytest.mark.gpu
@requires_cuda
def test_linear_cuda_qwen_vocab():
    check_linear("cuda", Shape(num_tokens=4096, vocab=151936, hidden=512, num_seqs=8, dtype="bf16"))
