"""linear_grpo_loss against the float64 reference on hidden @ weight.T: loss, log-probs,
advantages, metrics, grad_hidden and grad_weight; the 6·T·H·V FLOP budget; bounded memory."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from osvl_kernels import grpo_loss, linear_grpo_loss
from osvl_kernels.linear_grpo_loss import (
    LINEAR_CHUNK_BYTES,
    LOGITS_PER_WEIGHT,
    MIN_CHUNK_ROWS,
    add_matmul_,
    check_linear_inputs,
    grad_weight_accum_dtype_for,
    lm_head_chunk_rows,
    token_chunks,
)
from osvl_kernels.reference import reference_grpo_loss
from tests.kernels.packed import random_packed_batch

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("osvl_kernels.triton_token_pass") else [])
# The plan-level semantics (aggregation, estimator, options) are backend-independent and run on
# "torch"; the Triton interpreter is slow, so it covers one representative case per axis.
TRITON = BACKENDS[1:]
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
MATMUL_OPS = ("mm", "addmm", "matmul", "bmm", "baddbmm", "addmv", "mv", "dot", "linear")


def loss_inputs(batch: dict, override: dict | None = None) -> dict:
    inputs = {k: batch[k] for k in LOSS_KEYS}
    inputs.update(override or {})
    return inputs


def run_linear(batch, backend, *, dtype=torch.float32, override=None, chunk_size=None, **kwargs):
    hidden = batch["hidden"].to(dtype).clone().requires_grad_()
    weight = batch["weight"].to(dtype).clone().requires_grad_()
    inputs = loss_inputs(batch, override)
    out = linear_grpo_loss(hidden, weight, **inputs, backend=backend, chunk_size=chunk_size, **kwargs)
    out.loss.backward()
    return out, hidden.grad, weight.grad


def run_reference(batch, *, dtype=torch.float32, override=None, **kwargs):
    """float64 reference on the same (dtype-rounded) hidden and weight."""
    hidden = batch["hidden"].to(dtype).double().requires_grad_()
    weight = batch["weight"].to(dtype).double().requires_grad_()
    loss, logp, adv = reference_grpo_loss(hidden @ weight.T, **loss_inputs(batch, override), **kwargs)
    if loss.requires_grad:
        loss.backward()
    grad_h = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
    grad_w = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    return loss.detach(), logp, adv, grad_h, grad_w


def assert_matches_reference(batch, backend, *, chunk_size, override=None, tol=1e-5, **kwargs):
    out, grad_h, grad_w = run_linear(batch, backend, override=override, chunk_size=chunk_size, **kwargs)
    ref_loss, ref_logp, ref_adv, ref_h, ref_w = run_reference(batch, override=override, **kwargs)
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(out.logprobs.double(), ref_logp, rtol=tol, atol=tol)
    torch.testing.assert_close(out.advantages.double(), ref_adv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_h.double(), ref_h, rtol=tol, atol=tol)
    torch.testing.assert_close(grad_w.double(), ref_w, rtol=tol, atol=tol)
    return out


class MatmulCounter(TorchDispatchMode):
    """Records every matmul-family aten op; `flops` sums 2·m·k·n over the mm/addmm ones."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name in MATMUL_OPS:
            self.calls.append(name)
        if name in ("mm", "addmm"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss_agg", AGGS)
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "drgrpo"])
def test_matches_reference_across_aggregations_and_estimators(loss_agg, estimator):
    backend = "torch"
    batch = random_packed_batch(seed=AGGS.index(loss_agg) * 3 + len(estimator), vocab=67)
    assert_matches_reference(batch, backend, chunk_size=4, loss_agg=loss_agg, estimator=estimator, max_response_len=12)


OPTIONS = {
    "dual": dict(dual_clip=3.0),
    "kl": dict(kl_coef=0.05),
    "entropy": dict(entropy_coef=0.01),
    "temperature": dict(temperature=0.7),
    "population-noclamp": dict(std="population", clamp_fatal=False),
    "on-policy": dict(override={"old_logprobs": None}),
    "everything": dict(dual_clip=2.0, kl_coef=0.1, entropy_coef=0.02, temperature=1.3, eps_low=0.1, eps_high=0.5),
}


@pytest.mark.parametrize(
    "backend, options",
    [("torch", o) for o in OPTIONS.values()] + [(b, OPTIONS["everything"]) for b in TRITON],
    ids=[f"torch-{k}" for k in OPTIONS] + [f"{b}-everything" for b in TRITON],
)
def test_matches_reference_with_options(backend, options):
    batch = random_packed_batch(seed=7, vocab=128, num_seqs=8, group_size=4)
    assert_matches_reference(batch, backend, chunk_size=5, **options)


@pytest.mark.parametrize(
    "backend, chunk_size", [("torch", c) for c in (1, 2, 7, 1000, None)] + [(b, 3) for b in TRITON]
)
def test_chunks_that_split_sequences_give_the_same_result(backend, chunk_size):
    batch = random_packed_batch(seed=3, vocab=53, num_seqs=7, max_len=11)
    out = assert_matches_reference(batch, backend, chunk_size=chunk_size, kl_coef=0.1, entropy_coef=0.05)
    whole = run_linear(batch, backend, chunk_size=10_000, kl_coef=0.1, entropy_coef=0.05)[0]
    torch.testing.assert_close(out.loss, whole.loss, rtol=1e-6, atol=1e-6)


def test_precomputed_token_advantages():
    backend = "torch"
    batch = random_packed_batch(seed=11, vocab=40)
    T = batch["hidden"].shape[0]
    advantages = torch.randn(T, generator=torch.Generator().manual_seed(0))
    override = {"rewards": None, "group_ids": None, "advantages": advantages}
    out = assert_matches_reference(batch, backend, chunk_size=3, override=override)
    torch.testing.assert_close(out.advantages, override["advantages"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_keep_fp32_logprobs_and_input_dtype_grads(backend):
    batch = random_packed_batch(seed=5, vocab=100, num_seqs=8)
    out, grad_h, grad_w = run_linear(batch, backend, dtype=torch.bfloat16, chunk_size=6, kl_coef=0.1)
    ref_loss, ref_logp, _, ref_h, ref_w = run_reference(batch, dtype=torch.bfloat16, kl_coef=0.1)
    assert out.logprobs.dtype == torch.float32
    assert grad_h.dtype == torch.bfloat16 and grad_w.dtype == torch.bfloat16
    # The logits chunk is rounded to bf16 (rel. 2^-9 of |logit| <~ 10), so log-probs move by ~1e-2.
    torch.testing.assert_close(out.logprobs.double(), ref_logp, rtol=0, atol=8e-2)
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=2e-2, atol=2e-2)
    for grad, ref in ((grad_h, ref_h), (grad_w, ref_w)):
        assert ((grad.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_metrics_and_outputs_equal_grpo_loss_on_materialised_logits(backend):
    batch = random_packed_batch(seed=23, vocab=61, num_seqs=8)
    kwargs = dict(kl_coef=0.1, dual_clip=3.0, entropy_coef=0.01)
    fused = linear_grpo_loss(
        batch["hidden"], batch["weight"], **loss_inputs(batch), backend=backend, chunk_size=4, **kwargs
    )
    logits = batch["hidden"] @ batch["weight"].T
    plain = grpo_loss(logits, **loss_inputs(batch), backend=backend, **kwargs)
    assert fused.metrics.keys() == plain.metrics.keys()
    for key in plain.metrics:
        torch.testing.assert_close(fused.metrics[key], plain.metrics[key], rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-5, atol=1e-5)
    assert fused.metrics["num_valid_tokens"].item() > 0


def test_backward_runs_no_matmul_and_forward_costs_six_thv():
    backend = "torch"
    batch = random_packed_batch(seed=13, vocab=37)
    T, H = batch["hidden"].shape
    V = batch["weight"].shape[0]
    hidden = batch["hidden"].clone().requires_grad_()
    weight = batch["weight"].clone().requires_grad_()
    with MatmulCounter() as forward:
        out = linear_grpo_loss(hidden, weight, **loss_inputs(batch), backend=backend, chunk_size=4)
    with MatmulCounter() as backward:
        out.loss.backward()
    assert backward.calls == []
    assert forward.flops == 6 * T * H * V
    assert forward.calls.count("mm") + forward.calls.count("addmm") == 3 * len(token_chunks(T, 4))
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize(
    "needs, flops_per_thv",
    [((True, False), 4), ((False, True), 4), ((False, False), 2)],
    ids=["hidden-only", "weight-only", "no-grad"],
)
def test_gradients_only_for_inputs_that_require_them(needs, flops_per_thv):
    batch = random_packed_batch(seed=17, vocab=37)
    T, H = batch["hidden"].shape
    V = batch["weight"].shape[0]
    hidden = batch["hidden"].clone().requires_grad_(needs[0])
    weight = batch["weight"].clone().requires_grad_(needs[1])
    with MatmulCounter() as forward:
        out = linear_grpo_loss(hidden, weight, **loss_inputs(batch), backend="torch", chunk_size=5)
    assert forward.flops == flops_per_thv * T * H * V
    assert out.loss.requires_grad == any(needs)
    if any(needs):
        out.loss.backward()
    _, _, _, ref_h, ref_w = run_reference(batch)
    for tensor, need, ref in ((hidden, needs[0], ref_h), (weight, needs[1], ref_w)):
        if need:
            torch.testing.assert_close(tensor.grad.double(), ref, rtol=1e-5, atol=1e-5)
        else:
            assert tensor.grad is None


def test_gradient_scales_with_upstream_grad():
    batch = random_packed_batch(seed=19, vocab=29)
    _, base_h, base_w = run_linear(batch, "torch", chunk_size=3)
    hidden = batch["hidden"].clone().requires_grad_()
    weight = batch["weight"].clone().requires_grad_()
    out = linear_grpo_loss(hidden, weight, **loss_inputs(batch), backend="torch", chunk_size=3)
    (out.loss * -2.5).backward()
    torch.testing.assert_close(hidden.grad, base_h * -2.5)
    torch.testing.assert_close(weight.grad, base_w * -2.5)


def test_no_logits_sized_tensor_is_ever_created():
    batch = random_packed_batch(seed=29, vocab=67, num_seqs=10, max_len=12)
    T, H = batch["hidden"].shape
    V = batch["weight"].shape[0]
    chunk = 4
    assert T * V > max(V * H, T * H, chunk * V)

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else (out,):
                # Floating tensors only: the Triton interpreter stages kernel arguments as raw bytes.
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    LargestOutput.largest = max(LargestOutput.largest, x.numel())
            return out

    hidden = batch["hidden"].clone().requires_grad_()
    weight = batch["weight"].clone().requires_grad_()
    with LargestOutput():
        out = linear_grpo_loss(
            hidden, weight, **loss_inputs(batch), backend="torch", chunk_size=chunk, entropy_coef=0.1
        )
        out.loss.backward()
    assert LargestOutput.largest == max(V * H, T * H, chunk * V)


# --- helpers -------------------------------------------------------------------------------


def test_lm_head_chunk_rows_keeps_the_logits_chunk_a_fraction_of_the_weight():
    V, H = 151_936, 4096
    rows = lm_head_chunk_rows(V, H, torch.bfloat16)
    assert rows == 512  # H / 8 tokens: 32 chunks for 16k tokens
    assert rows * V * 2 <= V * H * 2 // LOGITS_PER_WEIGHT
    assert lm_head_chunk_rows(V // 2, H // 2, torch.bfloat16) * 2 == rows  # scale-free in V
    # The absolute byte cap still binds for wide models.
    wide = lm_head_chunk_rows(V, 16384, torch.float32)
    assert wide % 128 == 0 and wide * V * 4 <= LINEAR_CHUNK_BYTES < (wide + 128) * V * 4
    assert lm_head_chunk_rows(10**9, H, torch.float32) == 1  # a huge vocab still gets one row
    # A small hidden size still gets GEMM-sized chunks (H / 8 would be 32 tokens at H = 256).
    assert lm_head_chunk_rows(V, 256, torch.float32) == MIN_CHUNK_ROWS
    assert lm_head_chunk_rows(V, 4, torch.float32) == MIN_CHUNK_ROWS
    narrow_cap = LINEAR_CHUNK_BYTES // (4 * 100)  # a vocab whose byte cap allows only 100 rows
    assert lm_head_chunk_rows(narrow_cap, 4096, torch.float32) == 100  # below 128: not rounded
    assert lm_head_chunk_rows(V, H, torch.float32, chunk_size=17) == 17


def test_token_chunks_cover_every_token_once():
    assert token_chunks(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert token_chunks(8, 4) == [slice(0, 4), slice(4, 8)]
    assert token_chunks(0, 4) == []


def test_add_matmul_accumulates_half_inputs_in_fp32():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(33, 300, generator=g).bfloat16()
    b = torch.randn(300, 7, generator=g).bfloat16()
    acc = torch.full((33, 7), 1000.0)
    add_matmul_(acc, a, b)
    exact = 1000.0 + a.double() @ b.double()
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), exact, rtol=1e-6, atol=1e-3)
    # bf16 accumulation would lose the sum entirely at this magnitude (spacing 8 near 1000).
    assert (acc.double() - exact).abs().max() < 1e-2
    acc64 = torch.zeros(33, 7, dtype=torch.float64)
    add_matmul_(acc64, a.double(), b.double())
    torch.testing.assert_close(acc64, a.double() @ b.double())


def test_add_matmul_into_half_rounds_once_per_call():
    """A bf16 accumulator gets the fp32 sum of the whole K-long product, rounded once: exactly
    what rounding (acc + exact product) to bf16 gives, not K roundings of partial sums."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(40, 512, generator=g).bfloat16()
    b = torch.randn(512, 9, generator=g).bfloat16()
    start = torch.randn(40, 9, generator=g).bfloat16()
    acc = start.clone()
    add_matmul_(acc, a, b)
    assert acc.dtype == torch.bfloat16
    once = (start.double() + a.double() @ b.double()).bfloat16()
    # fp32 vs fp64 partial sums may flip a rounding at a tie-boundary: at most one bf16 ulp.
    ulp = once.double().abs() * 2**-7
    assert ((acc.double() - once.double()).abs() <= ulp + 1e-30).all()
    assert (acc.double() == once.double()).float().mean() > 0.95


@pytest.mark.parametrize(
    "accum, dtype", [(None, torch.bfloat16), (torch.float32, torch.bfloat16), (None, torch.float32)]
)
def test_grad_weight_accumulator_never_holds_a_wider_vh_buffer_than_asked(accum, dtype):
    """The default keeps dW in the weight's dtype: no fp32 [V, H] tensor is ever created."""
    batch = random_packed_batch(seed=37, vocab=64, num_seqs=6)
    V, H = batch["weight"].shape
    seen: set[torch.dtype] = set()

    class VHDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() >= V * H:
                    seen.add(x.dtype)
            return out

    hidden = batch["hidden"].to(dtype).clone().requires_grad_()
    weight = batch["weight"].to(dtype).clone().requires_grad_()
    with VHDtypes():
        out = linear_grpo_loss(
            hidden, weight, **loss_inputs(batch), backend="torch", chunk_size=5, grad_weight_accum_dtype=accum
        )
        out.loss.backward()
    wide = accum if accum is not None else dtype
    assert seen == {dtype, wide}
    assert weight.grad.dtype == dtype


def test_half_accumulation_error_is_bounded_by_one_rounding_per_chunk():
    """bf16 dW accumulation vs the fp32 accumulator, both against float64: the default pays at
    most ~sqrt(chunks) bf16 roundings, and never changes hidden's gradient or the loss."""
    batch = random_packed_batch(seed=41, vocab=64, num_seqs=10, max_len=16)
    _, _, _, ref_h, ref_w = run_reference(batch, dtype=torch.bfloat16)
    errors = {}
    for accum in (None, torch.float32):
        _, grad_h, grad_w = run_linear(
            batch, "torch", dtype=torch.bfloat16, chunk_size=4, grad_weight_accum_dtype=accum
        )
        errors[accum] = ((grad_w.double() - ref_w).norm() / ref_w.norm()).item()
        assert ((grad_h.double() - ref_h).norm() / ref_h.norm()).item() < 2e-2
    chunks = len(token_chunks(batch["hidden"].shape[0], 4))
    assert chunks >= 8
    assert errors[torch.float32] < 2e-2
    assert errors[None] < errors[torch.float32] + 2**-8 * chunks**0.5


def test_grad_weight_accum_dtype_choices():
    assert grad_weight_accum_dtype_for(torch.bfloat16, None) == torch.bfloat16
    assert grad_weight_accum_dtype_for(torch.bfloat16, torch.float32) == torch.float32
    assert grad_weight_accum_dtype_for(torch.float32, None) == torch.float32
    assert grad_weight_accum_dtype_for(torch.float64, torch.float64) == torch.float64
    for weight_dtype, bad in (
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float64),
    ):
        with pytest.raises(ValueError, match="grad_weight_accum_dtype must be"):
            grad_weight_accum_dtype_for(weight_dtype, bad)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(hidden=a["hidden"][0]), "hidden must be a 2-D"),
        (lambda a: a.update(weight=a["weight"][None]), "weight must be a 2-D"),
        (lambda a: a.update(hidden=a["hidden"].long()), "hidden must be fp32/bf16/fp16"),
        (lambda a: a.update(weight=a["weight"].double()), "weight dtype"),
        (lambda a: a.update(weight=a["weight"][:, :-1]), "hidden size mismatch"),
        (lambda a: a.update(weight=a["weight"][:0]), "no vocab rows"),
        (lambda a: a.update(target_ids=a["target_ids"][:-1]), "target_ids must have shape"),
        (lambda a: a.update(target_ids=a["target_ids"].float()), "target_ids must be a int"),
        (lambda a: a["target_ids"].__setitem__(a["loss_mask"].nonzero()[0, 0], 61), "target_ids of loss tokens"),
        (lambda a: a.update(chunk_size=0), "chunk_size must be a positive int"),
        (lambda a: a.update(chunk_size=2.0), "chunk_size must be a positive int"),
        (lambda a: a.update(grad_weight_accum_dtype=torch.bfloat16), "grad_weight_accum_dtype must be"),
        (lambda a: a.update(backend="cuda"), "unknown backend"),
        (lambda a: a.update(loss_agg="mean"), "unknown loss_agg"),
        (lambda a: a.update(token_step=None), "fatal_step needs token_step"),
        (lambda a: a["cu_seqlens"].__setitem__(-1, a["cu_seqlens"][-1] - 1), "cu_seqlens must end at T"),
        (lambda a: a.update(vocab_start=5), "needs tp_group"),
        (lambda a: a.update(tp_group=object()), "torch.distributed is not initialised"),
        (lambda a: a.update(temperature=0.0), "temperature must be > 0"),
    ],
)
def test_bad_input_raises_value_error_and_changes_nothing(mutate, message):
    batch = random_packed_batch(seed=31, vocab=61)
    leaves = batch["hidden"].clone().requires_grad_(), batch["weight"].clone().requires_grad_()
    args = dict(loss_inputs(batch), hidden=leaves[0], weight=leaves[1])
    mutate(args)
    args.setdefault("backend", "torch")
    snapshot = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        linear_grpo_loss(**args)
    for key, value in snapshot.items():
        assert torch.equal(args[key], value), key
    assert leaves[0].grad is None and leaves[1].grad is None


def test_check_linear_inputs_accepts_matching_tensors():
    hidden, weight = torch.randn(3, 4, dtype=torch.float16), torch.randn(5, 4, dtype=torch.float16)
    check_linear_inputs(hidden, weight, torch.tensor([0, 4, 2]))
    with pytest.raises(ValueError, match="target_ids must have shape"):
        check_linear_inputs(hidden, weight, torch.tensor([0, 4]))
