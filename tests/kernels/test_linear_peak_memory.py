"""Peak memory of linear_grpo_loss, measured from torch's CPU allocator events: the returned
gradients, one logits chunk and the torch backend's bounded temporaries, and nothing [V, H]-sized
beyond the weight gradient itself unless an fp32 accumulator is asked for.

A CPU's half-precision GEMM may copy (reorder) an operand inside torch.mm, and whether it does
depends on the CPU's instruction set and the GEMM library: that transient is measured on this
machine, by the same method, and allowed on top, so the bound holds on every CPU."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

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


def gemm_transient_bytes(hidden: torch.Tensor, weight: torch.Tensor) -> int:
    """What this machine's torch.mm allocates beyond its output for one chunk's logits and dH GEMMs."""
    h, w = hidden.detach()[:CHUNK], weight.detach()
    logits = torch.mm(h, w.t())
    forward = peak_allocated_bytes(lambda: torch.mm(h, w.t(), out=logits))
    backward = peak_allocated_bytes(lambda: torch.mm(logits, w, out=torch.empty_like(h)))
    return max(forward, backward - h.numel() * h.element_size())


def run_step(accum: torch.dtype | None) -> tuple[int, int]:
    batch = random_packed_batch(seed=43, vocab=V, num_seqs=6)
    T = batch["hidden"].shape[0]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.1).bfloat16().requires_grad_()
    inputs = {k: batch[k] for k in ("target_ids", "cu_seqlens", "loss_mask", "old_logprobs", "rewards", "group_ids", "fatal_step", "token_step")}

    def step():
        out = linear_grpo_loss(
            hidden, weight, **inputs, backend="torch", chunk_size=CHUNK, grad_weight_accum_dtype=accum, validate=False
        )
        out.loss.backward()

    step()  # warm-up
    hidden.grad = weight.grad = None
    return peak_allocated_bytes(step), T, gemm_transient_bytes(hidden, weight)


def test_default_peak_is_the_returned_gradients_plus_one_chunk():
    peak, T, gemm = run_step(None)
    grads = (V + T) * H * 2  # weight.grad + hidden.grad, bf16
    # bf16 logits chunk + the torch backend's fp32 block buffers (at most three [chunk, V]).
    chunk_and_temporaries = CHUNK * V * 2 + 3 * CHUNK * V * 4
    assert grads <= peak <= grads + chunk_and_temporaries + gemm + 64 * 1024
    # An fp32 [V, H] accumulator alone would be 2x weight.grad; with its cast, 3x.
    assert peak - gemm < 2 * V * H * 2


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
