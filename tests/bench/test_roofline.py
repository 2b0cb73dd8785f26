"""Peak table and bytes/FLOPs floors: the numbers every % of floor in bench/results rests on."""

import pytest

from bench.kernels.roofline import Peak, linear_floors, logits_floors, lookup_peak, percent_of_floor


@pytest.mark.parametrize(
    "name, tflops, tbps",
    [("NVIDIA H200", 989.0, 4.8), ("NVIDIA H100 80GB HBM3", 989.0, 3.35), ("NVIDIA H100 PCIe", 756.0, 2.0)],
)
def test_lookup_peak_matches_the_table(name, tflops, tbps):
    peak = lookup_peak(name, "bf16")
    assert (peak.tflops, peak.tbps) == (tflops, tbps)
    assert peak.source.startswith("table:")


def test_lookup_peak_overrides_and_unknown_devices():
    assert lookup_peak("NVIDIA H200", "bf16", tbps=4.0).tbps == 4.0
    assert lookup_peak("NVIDIA H200", "fp32").tflops == 494.0
    unknown = lookup_peak("x86_64", "bf16")
    assert (unknown.tflops, unknown.tbps, unknown.source) == (None, None, "unknown")
    assert lookup_peak("x86_64", "bf16", tflops=1.0, tbps=0.1) == Peak(1.0, 0.1, "cli")


@pytest.mark.parametrize("kwargs, message", [(dict(dtype_family="int8"), "dtype_family"), (dict(tbps=0.0), "tbps")])
def test_lookup_peak_rejects_bad_input(kwargs, message):
    args = dict(device_name="NVIDIA H200", dtype_family="bf16") | kwargs
    with pytest.raises(ValueError, match=message):
        lookup_peak(**args)


def test_logits_floor_is_the_issue_formula():
    T, V = 16384, 151936
    floors = logits_floors(T, V, 2, Peak(989.0, 4.8, "table:H200"))
    assert floors.issue_floor_bytes == 4 * T * V * 2
    assert floors.kernel_traffic_bytes == 3 * T * V * 2
    assert floors.min_bytes == 2 * T * V * 2
    assert floors.floor_ms == pytest.approx(4 * T * V * 2 / 4.8e12 * 1e3)
    assert logits_floors(T, V, 2, Peak(None, None, "unknown")).floor_ms is None


def test_linear_floor_is_compute_bound_at_the_target_shape():
    T, V, H = 16384, 151936, 4096
    floors = linear_floors(T, V, H, 2, Peak(989.0, 4.8, "table:H200"))
    assert floors.flops == 6 * T * H * V
    assert floors.floor_ms == pytest.approx(6 * T * H * V / 989e12 * 1e3)
    # a slow enough memory makes the byte floor win
    slow = linear_floors(T, V, H, 2, Peak(989.0, 1e-6, "cli"))
    assert slow.floor_ms == pytest.approx(floors.min_bytes / 1e6 * 1e3)


def test_percent_of_floor():
    assert percent_of_floor(2.0, 4.0) == 50.0
    assert percent_of_floor(None, 4.0) is None
    with pytest.raises(ValueError, match="measured time"):
        percent_of_floor(1.0, 0.0)
