"""Timing and peak-extra-memory of one case's forward+backward step.

GPU: CUDA events around each step (after warm-up), peak = torch.cuda.max_memory_allocated
during one step minus what was allocated before it (the inputs).
CPU: wall-clock around each step; peak = the process's resident-set high-water mark (VmHWM)
during one step minus the resident set before it, measured in a fresh subprocess per case
(`rss_probe.py`) with glibc's mmap threshold pinned so freed tensors go back to the OS
instead of hiding in malloc arenas. tracemalloc does not see torch's allocations.
CPU, allocator level (`cpu_allocated_peak_bytes`): torch's CPU allocator reports every
allocation and free to the profiler while memory profiling is on; the running sum of those
events over one step is the CPU analogue of max_memory_allocated - memory_allocated (frees of
tensors allocated before the step are not reported, so the inputs stay the baseline).
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from dataclasses import dataclass

import torch

from bench.kernels.cases import Case

# Passed to the CPU probe: every allocation >= 64 KiB is an mmap, returned to the OS on free.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    loss: float  # the loss of the first (warm-up) step


def time_step(case: Case, device: torch.device, warmup: int, reps: int) -> Timing:
    if warmup < 1 or reps < 1:
        raise ValueError(f"warmup and reps must be >= 1, got {warmup} and {reps}")
    loss = None
    for _ in range(warmup):
        case.reset()
        value = case.step()
        loss = float(value) if loss is None else loss
    times = []
    for _ in range(reps):
        case.reset()
        times.append(_timed_ms(case, device))
    return Timing(statistics.median(times), min(times), max(times), reps, loss)


def time_steps_interleaved(cases: dict[str, Case], device: torch.device, warmup: int, reps: int) -> dict[str, Timing]:
    """`time_step` for several cases, one step of each in turn per repetition: on a shared machine a
    load change hits every case alike, so the ratios between them hold even when the times drift."""
    if warmup < 1 or reps < 1:
        raise ValueError(f"warmup and reps must be >= 1, got {warmup} and {reps}")
    first = {}
    for name, case in cases.items():
        for _ in range(warmup):
            case.reset()
            value = case.step()
            first.setdefault(name, float(value))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, case in cases.items():
            case.reset()
            times[name].append(_timed_ms(case, device))
    return {name: Timing(statistics.median(t), min(t), max(t), reps, first[name]) for name, t in times.items()}


def _timed_ms(case: Case, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        case.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    case.step()
    return (time.perf_counter() - begin) * 1e3


def matmul_tflops(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, reps: int = 5) -> float:
    """Achieved dense matmul rate (TFLOP/s) of [m, k] @ [k, n] here: the rate the fused-linear FLOP
    floor is divided by, measured in the same run as the cases (clocks, power caps and library differ
    from the data sheet)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: library selection, clocks
    case = Case(lambda: torch.mm(a, b, out=out)[0, 0], leaves=[])
    timing = time_step(case, device, warmup=1, reps=reps)
    return 2.0 * m * k * n / (timing.median_ms * 1e9)


def cuda_peak_extra_bytes(case: Case) -> int:
    """Run one (already warmed-up) step; bytes allocated above the pre-step level at its peak."""
    case.reset()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    case.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def cpu_allocated_peak_bytes(case: Case) -> int:
    """Run one (already warmed-up) step; peak of torch CPU bytes allocated during it and still live."""
    from torch.profiler import ProfilerActivity, profile

    case.reset()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        case.step()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    if not events:
        raise RuntimeError("the profiler reported no CPU memory events (profile_memory unsupported?)")
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def rss_peak_extra_bytes(case: Case) -> int:
    """Run one (already warmed-up) step; resident-set high-water above the pre-step resident set.

    Linux only: writing 5 to /proc/self/clear_refs resets VmHWM to the current resident set.
    """
    case.reset()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _proc_status_bytes("VmRSS")
    case.step()
    return max(0, _proc_status_bytes("VmHWM") - base)
