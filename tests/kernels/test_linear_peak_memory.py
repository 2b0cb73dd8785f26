"""Peak memory of linear_grpo_loss, measured from torch's CPU allocator events: the returned
gradients, one logits chunk and the torch backend's bounded temporaries, and nothing [V, H]-sized
beyond the weight gradient itself unless an fp32 accumulator is asked for.

The GEMM backend's own scratch is not the kernel's to bound and differs between CPUs (with
AVX512-BF16 or AMX, oneDNN's bf16 GEMM copies its [V, H] operand into a blocked layout; other
CPUs take a path that allocates nothing), so each test measures it: every GEMM the step runs is
recorded and replayed alone, at the same shapes, strides and dtypes, and its peak allowed for."""

from __future__ import annotations

import functools

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from osvl_kernels import linear_grpo_loss
from tests.kernels.packed import random_packed_batch

V, H, CHUNK = 2048, 64, 4


def peak_allocated_bytes(fn) -> int:
    """Peak running sum of torch CPU allocations made (and not yet freed) while fn runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


class RecordGemms(TorchDispatchMode):
    """Records every matrix-multiply op dispatched inside it, with its arguments' layouts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "mm" in func.__name__.split(".")[0]:
            layout = lambda x: (x.shape, x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x  # noqa: E731
            self.calls.append((func, tree_map(layout, args), tree_map(layout, kwargs)))
        return func(*args, **kwargs)


def gemm_scratch_bytes(fn) -> int:
    """The most any one GEMM that `fn` runs allocates for itself beyond its result: each recorded
    GEMM is replayed on fresh tensors of the same layout (outputs preallocated), its peak measured."""
    recorder = RecordGemms()
    with recorder:
        fn()
    assert recorder.calls, "the step ran no GEMM: the recorder missed them"
    scratch = 0

    def is_layout(x):
        return isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], torch.dtype)

    def make(x):
        return torch.empty_strided(x[0], x[1], dtype=x[2]).normal_() if is_layout(x) else x

    for func, args, kwargs in {(f, repr(a), repr(k)): (f, a, k) for f, a, k in recorder.calls}.values():
        real_args = tree_map(make, args, is_leaf=is_layout)
        real_kwargs = tree_map(make, kwargs, is_leaf=is_layout)
        func(*real_args, **real_kwargs)  # warm-up, as the step had
        result_bytes = 0 if "out" in real_kwargs or func.__name__.endswith("_") else None
        peak = peak_allocated_bytes(functools.partial(func, *real_args, **real_kwargs))
        if result_bytes is None:
            shape = func(*real_args, **real_kwargs)
            result_bytes = shape.numel() * shape.element_size()
        scratch = max(scratch, peak - result_bytes)
    return scratch


def run_step(accum: torch.dtype | None) -> tuple[int, int, int]:
    batch = random_packed_batch(seed=43, vocab=V, num_seqs=6)
    T = batch["hidden"].shape[0]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.1).bfloat16().requires_grad_()
    inputs = {
        k: batch[k]
        for k in (
            "target_ids",
            "cu_seqlens",
            "loss_mask",
            "old_logprobs",
            "rewards",
            "group_ids",
            "fatal_step",
            "token_step",
        )
    }

    def step():
        out = linear_grpo_loss(
            hidden, weight, **inputs, backend="torch", chunk_size=CHUNK, grad_weight_accum_dtype=accum, validate=False
        )
        out.loss.backward()

    step()  # warm-up
    hidden.grad = weight.grad = None
    scratch = gemm_scratch_bytes(step)
    hidden.grad = weight.grad = None
    return peak_allocated_bytes(step), T, scratch


def test_default_peak_is_the_returned_gradients_plus_one_chunk():
    peak, T, scratch = run_step(None)
    grads = (V + T) * H * 2  # weight.grad + hidden.grad, bf16
    # bf16 logits chunk + the torch backend's fp32 token-pass temporaries (a handful of [chunk, V]).
    chunk_and_temporaries = CHUNK * V * 2 + 8 * CHUNK * V * 4
    assert grads <= peak <= grads + chunk_and_temporaries + scratch + 64 * 1024
    # An fp32 [V, H] accumulator alone would be 2x weight.grad; with its cast, 3x.
    assert peak - scratch < 2 * V * H * 2


def test_gemm_scratch_is_measured_from_the_replayed_gemms():
    w = torch.randn(V, H).bfloat16()
    out = torch.empty(CHUNK, H, dtype=torch.bfloat16)
    x = torch.randn(CHUNK, V).bfloat16()
    # A GEMM whose result is preallocated: its scratch is whatever the backend allocated.
    assert gemm_scratch_bytes(lambda: torch.mm(x, w, out=out)) == peak_allocated_bytes(lambda: torch.mm(x, w, out=out))
    # A GEMM that allocates its result: the result's bytes are the caller's, not scratch.
    a, b = torch.randn(128, CHUNK), torch.randn(CHUNK, H)
    assert gemm_scratch_bytes(lambda: torch.mm(a, b)) == peak_allocated_bytes(lambda: torch.mm(a, b)) - 128 * H * 4


def test_fp32_accumulator_costs_its_bytes():
    peak, T, _ = run_step(torch.float32)
    # fp32 accumulator (4 B) and its bf16 cast (2 B) live together at the end, beside hidden.grad.
    assert peak >= V * H * (4 + 2) + T * H * 2


def test_torch_backend_rows_follow_the_working_set_budget(monkeypatch):
    import osvl_kernels.token_pass as token_pass_module

    assert token_pass_module.chunk_rows(1000, budget_bytes=12 * 1000 * 7) == 7  # three fp32 [7, 1000]
    assert token_pass_module.chunk_rows(10**9, budget_bytes=1) == 1
    monkeypatch.setattr(token_pass_module, "TORCH_CHUNK_BYTES", 12 * 1000 * 3)
    assert token_pass_module.chunk_rows(1000) == 3  # the module budget is read at call time
