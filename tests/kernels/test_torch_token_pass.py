"""The torch backend's block machinery (token_pass.py): results do not depend on how rows are split
into blocks, which buffers alias which, or what invalid rows hold; the working set stays one
cache-sized block beside the gradient."""

from __future__ import annotations

import pytest
import torch

import osvl_kernels.token_pass as token_pass_module
from osvl_kernels import grpo_loss, linear_grpo_loss
from osvl_kernels.reference import reference_grpo_loss
from osvl_kernels.token_pass import expected_logit, softmax_block
from tests.kernels.packed import random_packed_batch
from tests.kernels.test_linear_peak_memory import peak_allocated_bytes

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
EVERY_TERM = dict(dual_clip=3.0, kl_coef=0.05, entropy_coef=0.02, temperature=0.8)


def one_row_per_block(monkeypatch, vocab: int) -> None:
    monkeypatch.setattr(token_pass_module, "TORCH_CHUNK_BYTES", 3 * 4 * vocab)


def run(batch: dict, logits: torch.Tensor, inplace: bool = False, **options):
    logits = logits.clone().requires_grad_()
    out = grpo_loss(logits, **{k: batch[k] for k in LOSS_KEYS}, backend="torch", inplace_grad=inplace, **options)
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inplace", [False, True], ids=["grad_buffer", "inplace"])
@pytest.mark.parametrize("options", [{}, EVERY_TERM], ids=["plain", "every_term"])
def test_blocks_of_one_row_match_one_block_and_float64(monkeypatch, dtype, inplace, options):
    batch = random_packed_batch(seed=3, vocab=50, num_seqs=7, dtype=dtype)
    logits = batch["logits"]
    whole, whole_grad = run(batch, logits, inplace, **options)
    one_row_per_block(monkeypatch, 50)
    split, split_grad = run(batch, logits, inplace, **options)
    torch.testing.assert_close(split.loss, whole.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-5, atol=1e-7)
    for key in whole.metrics:
        torch.testing.assert_close(split.metrics[key], whole.metrics[key], rtol=1e-5, atol=1e-7)
    ref_logits = logits.double().requires_grad_()
    ref_loss, ref_logp, _ = reference_grpo_loss(ref_logits, **{k: batch[k] for k in LOSS_KEYS}, **options)
    ref_loss.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(split.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split.logprobs.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_grad.double(), ref_logits.grad, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("options", [{}, EVERY_TERM], ids=["plain", "every_term"])
def test_invalid_rows_get_zero_gradient_whatever_they_hold(monkeypatch, options):
    """Rows outside the loss (mask, fatal) may hold nan/inf garbage: the gradient there is exactly 0 and
    nothing else changes."""
    batch = random_packed_batch(seed=5, vocab=40, num_seqs=6)
    clean, clean_grad = run(batch, batch["logits"], **options)
    invalid = clean.logprobs == 0
    assert invalid.any() and (~invalid).any()
    dirty = batch["logits"].clone()
    dirty[invalid] = float("nan")
    dirty[invalid.nonzero()[0, 0], 0] = float("inf")
    one_row_per_block(monkeypatch, 40)
    out, grad = run(batch, dirty, **options)
    assert torch.count_nonzero(grad[invalid]) == 0 and not grad.isnan().any()
    torch.testing.assert_close(out.loss, clean.loss)
    torch.testing.assert_close(grad, clean_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("inplace", [False, True], ids=["grad_buffer", "inplace"])
def test_masked_vocab_matches_the_trimmed_vocab_in_every_buffer_layout(monkeypatch, inplace):
    """-inf entries (padded vocab) count as absent, whether the products are formed in a scratch
    buffer or in the consumed logits (in place), in a block of one row or of many."""
    batch = random_packed_batch(seed=9, vocab=40)
    batch["target_ids"] = batch["target_ids"] % 30
    padded = batch["logits"].clone()
    padded[:, 30:] = float("-inf")
    padded[1, 5] = float("-inf")
    trimmed = padded[:, :30]
    for blocks in ("many_rows", "one_row"):
        if blocks == "one_row":
            one_row_per_block(monkeypatch, 40)
        out, grad = run(batch, padded, inplace, entropy_coef=0.05)
        want, want_grad = run(batch, trimmed, inplace, entropy_coef=0.05)
        torch.testing.assert_close(out.loss, want.loss)
        torch.testing.assert_close(out.metrics["entropy_mean"], want.metrics["entropy_mean"])
        torch.testing.assert_close(grad[:, :30], want_grad)
        assert torch.count_nonzero(grad[:, 30:]) == 0 and grad[1, 5] == 0


def test_softmax_block_gives_the_log_sum_exp():
    z = torch.randn(5, 300, dtype=torch.float64).float() * 6.0
    z[2, :290] = float("-inf")
    probs = torch.empty_like(z)
    m, lse = softmax_block(z, probs)
    torch.testing.assert_close(lse, torch.logsumexp(z.double(), dim=-1).float())
    torch.testing.assert_close(m, z.amax(dim=-1))
    torch.testing.assert_close(probs, torch.softmax(z, dim=-1))


@pytest.mark.parametrize("consume", [False, True], ids=["scratch", "in_place"])
def test_expected_logit_counts_masked_entries_as_zero(consume):
    z = torch.randn(4, 64) * 3.0
    z[1, ::2] = float("-inf")
    z[3, 0] = float("nan")  # a nan logit stays nan: nothing hides it
    probs = torch.softmax(z, dim=-1)
    finite = torch.where(probs > 0, z, torch.zeros_like(z))
    want = (probs.double() * finite.double()).sum(dim=-1).float()
    z_in = z.clone()
    got = expected_logit(probs, z_in, z_in if consume else torch.empty_like(z))
    torch.testing.assert_close(got[:3], want[:3])
    assert got[3].isnan()


def test_peak_is_the_gradient_plus_one_block(monkeypatch):
    """fp32 logits, separate gradient buffer: the pass's working set is one [rows, V] scratch block
    (the probabilities go straight into the gradient), never a [T, V] temporary."""
    T, V, rows = 256, 512, 16
    monkeypatch.setattr(token_pass_module, "TORCH_CHUNK_BYTES", 3 * 4 * V * rows)
    batch = random_packed_batch(seed=11, vocab=V, num_seqs=24, max_len=20)
    logits = torch.randn(batch["target_ids"].shape[0], V).requires_grad_()
    T = logits.shape[0]
    inputs = {k: batch[k] for k in LOSS_KEYS}

    def step():
        grpo_loss(logits, **inputs, backend="torch", validate=False).loss.backward()

    step()
    logits.grad = None
    peak = peak_allocated_bytes(step)
    gradient, block = T * V * 4, rows * V * 4
    assert gradient <= peak <= gradient + block + 64 * 1024


def test_linear_fp32_chunks_use_one_block_buffer(monkeypatch):
    """fp32 fused-linear: the logits chunk turns into its gradient in place, so beside it the pass
    needs only the probabilities' block."""
    V, H, chunk, rows = 512, 32, 64, 16
    monkeypatch.setattr(token_pass_module, "TORCH_CHUNK_BYTES", 3 * 4 * V * rows)
    batch = random_packed_batch(seed=12, vocab=V, num_seqs=24, max_len=20)
    T = batch["target_ids"].shape[0]
    hidden = torch.randn(T, H).requires_grad_()
    weight = (torch.randn(V, H) * 0.1).requires_grad_()
    inputs = {k: batch[k] for k in LOSS_KEYS}

    def step():
        linear_grpo_loss(hidden, weight, **inputs, backend="torch", chunk_size=chunk, validate=False).loss.backward()

    step()
    hidden.grad = weight.grad = None
    peak = peak_allocated_bytes(step)
    grads, logits_chunk, block = (T + V) * H * 4, chunk * V * 4, rows * V * 4
    assert grads + logits_chunk <= peak <= grads + logits_chunk + block + 64 * 1024
