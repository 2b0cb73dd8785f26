"""token_logprobs / linear_token_logprobs against the float64 reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from osvl_kernels import linear_token_logprobs, token_logprobs
from osvl_kernels.reference import reference_token_logprobs

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("osvl_kernels.triton_token_pass") else [])


def random_rows(seed: int, T: int = 13, V: int = 67, H: int = 16, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        logits=(torch.randn(T, V, generator=g) * 3.0).to(dtype),
        target_ids=torch.randint(0, V, (T,), generator=g),
        hidden=torch.randn(T, H, generator=g).to(dtype),
        weight=(torch.randn(V, H, generator=g) * 0.5).to(dtype),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("V, temperature", [(67, 1.0), (128, 0.6), (1000, 1.7)])
def test_token_logprobs_match_reference(backend, V, temperature):
    rows = random_rows(seed=V, V=V)
    logp, entropy = token_logprobs(
        rows["logits"], rows["target_ids"], temperature=temperature, return_entropy=True, backend=backend
    )
    ref_logp, ref_entropy = reference_token_logprobs(rows["logits"], rows["target_ids"], temperature)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)
    only_logp = token_logprobs(rows["logits"], rows["target_ids"], temperature=temperature, backend=backend)
    torch.testing.assert_close(only_logp, logp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logits_give_fp32_logprobs_of_the_rounded_logits(backend):
    rows = random_rows(seed=2, dtype=torch.bfloat16)
    logp = token_logprobs(rows["logits"], rows["target_ids"], backend=backend)
    ref_logp, _ = reference_token_logprobs(rows["logits"], rows["target_ids"])
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)


def test_no_grad_even_for_logits_that_require_grad():
    rows = random_rows(seed=3)
    logits = rows["logits"].requires_grad_()
    logp, entropy = token_logprobs(logits, rows["target_ids"], return_entropy=True, backend="torch")
    assert not logp.requires_grad and not entropy.requires_grad
    hidden = rows["hidden"].requires_grad_()
    assert not linear_token_logprobs(hidden, rows["weight"], rows["target_ids"], backend="torch").requires_grad


def test_padded_vocab_entries_are_ignored_and_logp_is_at_most_zero():
    rows = random_rows(seed=4, V=40)
    target = rows["target_ids"] % 30
    padded = rows["logits"].clone()
    padded[:, 30:] = float("-inf")
    padded[0, :] = -1e4
    padded[0, target[0]] = 50.0  # a near-certain token: logp rounds to 0, never above
    logp, entropy = token_logprobs(padded, target, return_entropy=True, backend="torch")
    ref_logp, ref_entropy = reference_token_logprobs(padded[:, :30], target)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert (logp <= 0).all() and logp[0].item() == 0.0
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "backend, chunk_size", [("torch", 1), ("torch", 4), ("torch", None), *[(b, 5) for b in BACKENDS[1:]]]
)
def test_linear_token_logprobs_match_reference(backend, chunk_size):
    rows = random_rows(seed=5, T=11, V=53)
    logp, entropy = linear_token_logprobs(
        rows["hidden"],
        rows["weight"],
        rows["target_ids"],
        temperature=0.8,
        return_entropy=True,
        chunk_size=chunk_size,
        backend=backend,
    )
    logits = rows["hidden"].double() @ rows["weight"].double().T
    ref_logp, ref_entropy = reference_token_logprobs(logits, rows["target_ids"], 0.8)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-5)


def test_linear_token_logprobs_never_build_the_logits():
    rows = random_rows(seed=6, T=40, V=67, H=8)
    T, V, H, chunk = 40, 67, 8, 3
    largest = 0

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                largest = max(largest, out.numel())
            return out

    with Largest():
        linear_token_logprobs(rows["hidden"], rows["weight"], rows["target_ids"], chunk_size=chunk, backend="torch")
    assert largest == max(chunk * V, V * H, T * H) < T * V


def test_bf16_linear_token_logprobs_are_close_to_the_exact_ones():
    rows = random_rows(seed=7, dtype=torch.bfloat16)
    logp = linear_token_logprobs(rows["hidden"], rows["weight"], rows["target_ids"], chunk_size=4, backend="torch")
    logits = rows["hidden"].double() @ rows["weight"].double().T
    ref_logp, _ = reference_token_logprobs(logits, rows["target_ids"])
    # Only the bf16 rounding of the logits chunk (rel. 2^-9 of |logit|) separates them.
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=5e-2)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(logits=a["logits"][0]), "logits must be a 2-D"),
        (lambda a: a.update(logits=a["logits"].long()), "logits must be fp32/bf16/fp16"),
        (lambda a: a.update(target_ids=a["target_ids"][:-1]), "target_ids must have shape"),
        (lambda a: a["target_ids"].__setitem__(0, -100), r"every target_id must be in \[0, 67\)"),
        (lambda a: a["target_ids"].__setitem__(3, 67), r"every target_id must be in \[0, 67\)"),
        (lambda a: a.update(temperature=0.0), "temperature must be a finite number > 0"),
        (lambda a: a.update(temperature=float("nan")), "temperature must be a finite number > 0"),
        (lambda a: a.update(backend="cpu"), "unknown backend"),
        (lambda a: a.update(vocab_start=3), "needs tp_group"),
    ],
)
def test_token_logprobs_bad_input(mutate, message):
    rows = random_rows(seed=8)
    args = dict(logits=rows["logits"], target_ids=rows["target_ids"], backend="torch")
    mutate(args)
    targets = args["target_ids"].clone()
    with pytest.raises(ValueError, match=message):
        token_logprobs(**args)
    assert torch.equal(args["target_ids"], targets)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(weight=a["weight"][:, 1:]), "hidden size mismatch"),
        (lambda a: a.update(weight=a["weight"].half()), "weight dtype"),
        (lambda a: a.update(hidden=a["hidden"][None]), "hidden must be a 2-D"),
        (lambda a: a["target_ids"].__setitem__(1, 1000), r"every target_id must be in \[0, 67\)"),
        (lambda a: a.update(chunk_size=-2), "chunk_size must be a positive int"),
        (lambda a: a.update(temperature=-1.0), "temperature must be a finite number > 0"),
    ],
)
def test_linear_token_logprobs_bad_input(mutate, message):
    rows = random_rows(seed=9)
    args = dict(hidden=rows["hidden"], weight=rows["weight"], target_ids=rows["target_ids"], backend="torch")
    mutate(args)
    with pytest.raises(ValueError, match=message):
        linear_token_logprobs(**args)


def test_validate_false_skips_the_target_check():
    rows = random_rows(seed=10)
    targets = rows["target_ids"].clone()
    targets[0] = 10**6
    logp = token_logprobs(rows["logits"], targets, backend="torch", validate=False)
    ref_logp, _ = reference_token_logprobs(rows["logits"][1:], rows["target_ids"][1:])
    torch.testing.assert_close(logp[1:].double(), ref_logp, rtol=1e-5, atol=1e-5)
