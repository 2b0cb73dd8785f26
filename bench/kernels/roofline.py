"""Bytes/FLOPs floors of the GRPO loss problem and the accelerator peaks they are divided by.

Floors are properties of the packed problem (T tokens x V vocab), not of an implementation, so
every case of one kind is measured against the same floor; padding a layout costs that case.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense (no sparsity) peaks from the vendor data sheets, per dtype family; "fp32" means TF32
# tensor-core matmul. First substring match on torch.cuda.get_device_name() wins.
PEAKS: tuple[tuple[str, dict[str, float], float], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}, 2.0),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}, 4.8),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}, 3.35),
    ("H800", {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}, 3.35),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, 2.0),
)


@dataclass(frozen=True)
class Peak:
    """Peak matmul rate (TFLOP/s) and memory bandwidth (TB/s); None where unknown (e.g. CPU)."""

    tflops: float | None
    tbps: float | None
    source: str  # "table:<key>", "cli" or "unknown"


def lookup_peak(device_name: str, dtype_family: str, tflops: float | None = None, tbps: float | None = None) -> Peak:
    """Peak for a device; explicit `tflops`/`tbps` override the table (e.g. a clock-capped part)."""
    if dtype_family not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype_family must be bf16, fp16 or fp32, got {dtype_family!r}")
    for value, name in ((tflops, "tflops"), (tbps, "tbps")):
        if value is not None and not value > 0:
            raise ValueError(f"peak {name} must be > 0, got {value}")
    for key, rates, bandwidth in PEAKS:
        if key.lower() in device_name.lower():
            return Peak(
                tflops if tflops is not None else rates[dtype_family],
                tbps if tbps is not None else bandwidth,
                "cli" if (tflops is not None and tbps is not None) else f"table:{key}",
            )
    source = "cli" if (tflops is not None or tbps is not None) else "unknown"
    return Peak(tflops, tbps, source)


@dataclass(frozen=True)
class Floors:
    """Work of one forward+backward of the loss and the fastest time the peaks allow."""

    issue_floor_bytes: int  # 4*T*V*itemsize: the bandwidth bound the first target was stated against
    kernel_traffic_bytes: int  # 3*T*V*itemsize: our one-pass model (read logits twice, write grad once)
    min_bytes: int  # read inputs once + write gradients once: no implementation can move less
    flops: int  # 6*T*H*V for the fused-linear kind (fwd matmul + dH + dW), 0 for logits-level
    floor_ms: float | None  # the roofline floor: max(bytes / bandwidth, flops / peak) of the kind


def logits_floors(num_tokens: int, vocab: int, itemsize: int, peak: Peak) -> Floors:
    tv = num_tokens * vocab * itemsize
    floor_ms = None if peak.tbps is None else 4 * tv / (peak.tbps * 1e12) * 1e3
    return Floors(4 * tv, 3 * tv, 2 * tv, 0, floor_ms)


def linear_floors(num_tokens: int, vocab: int, hidden: int, itemsize: int, peak: Peak) -> Floors:
    flops = 6 * num_tokens * hidden * vocab
    moved = 2 * (num_tokens * hidden + vocab * hidden) * itemsize  # read H, W; write dH, dW
    times = []
    if peak.tflops is not None:
        times.append(flops / (peak.tflops * 1e12) * 1e3)
    if peak.tbps is not None:
        times.append(moved / (peak.tbps * 1e12) * 1e3)
    return Floors(moved, moved, moved, flops, max(times) if times else None)


def percent_of_floor(floor_ms: float | None, measured_ms: float) -> float | None:
    """100 means the measured time equals the floor; higher is impossible up to timer noise."""
    if floor_ms is None:
        return None
    if not measured_ms > 0:
        raise ValueError(f"measured time must be > 0 ms, got {measured_ms}")
    return 100.0 * floor_ms / measured_ms
