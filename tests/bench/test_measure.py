"""Timing and peak-memory probes measure what they claim (no timing assertions)."""

import pytest
import torch

from bench.kernels.cases import Case
from bench.kernels.measure import cuda_peak_extra_bytes, rss_peak_extra_bytes, time_step

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
