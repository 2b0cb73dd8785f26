"""Timing and peak-memory probes measure what they claim (no timing assertions)."""

import pytest
import torch

from bench.kernels.cases import Case
from bench.kernels.measure import cuda_peak_extra_bytes, rss_peak_extra_bytes, time_step, time_steps_interleaved

MIB = 2**20


def allocating_case(num_bytes: int, device: str = "cpu") -> Case:
    """A step that writes (so the pages become resident) and frees a buffer of `num_bytes`."""
    calls = []

    def step() -> torch.Tensor:
        buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
        calls.append(1)
        return buffer.sum() / len(calls)

    return Case(step, leaves=[])


def test_time_step_reports_the_first_loss_and_ordered_stats():
    timing = time_step(allocating_case(4 * MIB), torch.device("cpu"), warmup=2, reps=3)
    assert timing.loss == MIB  # the first warm-up step, not a later one
    assert 0 < timing.min_ms <= timing.median_ms <= timing.max_ms
    assert timing.reps == 3


def test_interleaved_timing_alternates_the_cases_and_keeps_each_first_loss():
    order = []

    def case(name: str, value: float) -> Case:
        def step() -> torch.Tensor:
            order.append(name)
            return torch.tensor(value * len(order))

        return Case(step, leaves=[])

    timings = time_steps_interleaved({"a": case("a", 1.0), "b": case("b", 10.0)}, torch.device("cpu"), warmup=2, reps=3)
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3  # warm-ups per case, then one step of each in turn
    assert timings["a"].loss == 1.0 and timings["b"].loss == 30.0  # each case's first warm-up step
    assert all(t.reps == 3 and 0 < t.min_ms <= t.median_ms <= t.max_ms for t in timings.values())
    with pytest.raises(ValueError, match="reps"):
        time_steps_interleaved({"a": case("a", 1.0)}, torch.device("cpu"), warmup=1, reps=0)


def test_time_step_rejects_zero_reps():
    with pytest.raises(ValueError, match="reps"):
        time_step(allocating_case(MIB), torch.device("cpu"), warmup=1, reps=0)


def test_rss_probe_sees_a_transient_allocation():
    small = rss_peak_extra_bytes(allocating_case(MIB))
    big = rss_peak_extra_bytes(allocating_case(96 * MIB))
    assert big >= 90 * MIB  # freed before the step returns, still seen by the high-water mark
    assert small < 48 * MIB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_extra_bytes_sees_a_transient_allocation():
    case = allocating_case(256 * MIB, "cuda")
    case.step()
    assert 256 * MIB <= cuda_peak_extra_bytes(case) < 300 * MIB
    timing = time_step(case, torch.device("cuda"), warmup=1, reps=2)
    assert timing.median_ms > 0
