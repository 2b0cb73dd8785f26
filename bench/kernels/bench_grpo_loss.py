"""Forward+backward time and peak extra memory of GRPO loss implementations on one packed batch.

    python bench/kernels/bench_grpo_loss.py                 # CUDA: T=16384 V=151936 H=4096 bf16
    python bench/kernels/bench_grpo_loss.py --device cpu    # CPU: T=2048 V=32000 H=256 fp32

Cases (see cases.py): osvl grpo_loss and linear_grpo_loss, Liger's Triton GRPO loss (padded and
one row per token), Liger's chunked fused-linear GRPO loss, torch eager materialised and
torch.compile. Every number is measured in this process against the same workload, so the
ratios are like for like. Writes <out-dir>/<name>-<gpu|cpu>-<commit>.json after every case
(`"complete": false` until the last), so a run cut short by a timeout still leaves its results.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.kernels.cases import CASES, Case, CaseOptions, Unavailable, build_case  # noqa: E402
from bench.kernels.measure import (  # noqa: E402
    MALLOC_ENV,
    Timing,
    cuda_peak_extra_bytes,
    matmul_tflops,
    time_step,
    time_steps_interleaved,
)
from bench.kernels.report import (  # noqa: E402
    SCHEMA,
    add_ratios,
    device_name,
    device_tag,
    git_info,
    result_path,
    summarize,
    versions,
    write_record,
)
from bench.kernels.roofline import Peak, linear_floors, logits_floors, lookup_peak, percent_of_floor  # noqa: E402
from bench.kernels.workload import Shape, Workload, make_workload, reference_loss  # noqa: E402

DEFAULT_SHAPES = {
    "cuda": Shape(num_tokens=16384, vocab=151936, hidden=4096, num_seqs=16, dtype="bf16"),
    "cpu": Shape(num_tokens=2048, vocab=32000, hidden=256, num_seqs=8, dtype="fp32"),
}
PROBE_TIMEOUT_S = 600


@dataclass(frozen=True)
class BenchConfig:
    device: str
    shape: Shape
    cases: tuple[str, ...]
    warmup: int
    reps: int
    seed: int
    options: CaseOptions
    peak_tflops: float | None
    peak_tbps: float | None
    name: str
    out_dir: Path
    cpu_memory: bool  # measure CPU peak RSS in a subprocess per case
    interleave: bool = False  # time every case's steps in turn (all cases built first)
    matmul_rate: bool = False  # measure the lm_head GEMM's rate here: the fused-linear floor at that rate
    measured_tflops: float | None = None  # filled in by run() when matmul_rate


def parse_args(argv: list[str]) -> BenchConfig:
    """CLI -> config; raises ValueError on values argparse cannot check."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tokens", type=int, help="T, packed tokens")
    p.add_argument("--vocab", type=int, help="V")
    p.add_argument("--hidden", type=int, help="H (fused-linear cases)")
    p.add_argument("--seqs", type=int, help="number of packed sequences")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    p.add_argument("--warmup", type=int, help="untimed steps first (default: 3 on CUDA, 1 on CPU)")
    p.add_argument("--reps", type=int, help="timed steps, median reported (default: 10 on CUDA, 3 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--osvl-backend", choices=["auto", "triton", "torch"], help="default: auto on CUDA, torch on CPU")
    p.add_argument("--inplace-grad", action="store_true", help="gradients overwrite the logits (osvl and Liger)")
    p.add_argument("--liger-compiled", choices=["on", "off"], help="default: on for CUDA, off on CPU")
    p.add_argument("--liger-chunk-size", type=int, default=1)
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the torch_compile case")
    p.add_argument("--peak-tflops", type=float, help="override the peak dense matmul TFLOP/s")
    p.add_argument("--peak-tbps", type=float, help="override the peak memory bandwidth TB/s")
    p.add_argument("--name", default="grpo_loss")
    p.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or REPO / "bench" / "results"))
    p.add_argument("--no-cpu-memory", action="store_true", help="skip the per-case RSS subprocesses on CPU")
    p.add_argument(
        "--matmul-rate",
        action="store_true",
        help="measure the [T, H] x [H, V] matmul rate first; linear cases get their floor at that rate",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="build every case first, then time one step of each in turn per rep (shared machines)",
    )
    a = p.parse_args(argv)

    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device (use --device cpu)")
    base = DEFAULT_SHAPES[a.device]
    shape = Shape(
        num_tokens=a.tokens if a.tokens is not None else base.num_tokens,
        vocab=a.vocab if a.vocab is not None else base.vocab,
        hidden=a.hidden if a.hidden is not None else base.hidden,
        num_seqs=a.seqs if a.seqs is not None else base.num_seqs,
        dtype=a.dtype or base.dtype,
    )
    cases = tuple(c.strip() for c in a.cases.split(",") if c.strip())
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ValueError(f"unknown or empty --cases {unknown}; expected a subset of {list(CASES)}")
    warmup = a.warmup if a.warmup is not None else (3 if a.device == "cuda" else 1)
    reps = a.reps if a.reps is not None else (10 if a.device == "cuda" else 3)
    if warmup < 1 or reps < 1:
        raise ValueError(f"--warmup and --reps must be >= 1, got {warmup} and {reps}")
    if a.liger_chunk_size < 1:
        raise ValueError(f"--liger-chunk-size must be >= 1, got {a.liger_chunk_size}")
    compiled = a.liger_compiled == "on" if a.liger_compiled else a.device == "cuda"
    options = CaseOptions(
        osvl_backend=a.osvl_backend or ("auto" if a.device == "cuda" else "torch"),
        inplace_grad=a.inplace_grad,
        liger_compiled=compiled,
        liger_chunk_size=a.liger_chunk_size,
        compile_backend=a.compile_backend,
    )
    return BenchConfig(
        device=a.device,
        shape=shape,
        cases=cases,
        warmup=warmup,
        reps=reps,
        seed=a.seed,
        options=options,
        peak_tflops=a.peak_tflops,
        peak_tbps=a.peak_tbps,
        name=a.name,
        out_dir=a.out_dir,
        cpu_memory=not a.no_cpu_memory,
        interleave=a.interleave,
        matmul_rate=a.matmul_rate,
    )


def probe_cpu_memory(config: BenchConfig, case_name: str) -> dict:
    """Peak extra RSS of one case, measured in a fresh interpreter (rss_probe.py)."""
    spec = {"case": case_name, "shape": asdict(config.shape), "options": asdict(config.options), "seed": config.seed}
    env = {
        **os.environ,
        **MALLOC_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.kernels.rss_probe", json.dumps(spec)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"memory probe timed out after {PROBE_TIMEOUT_S}s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "error", "reason": f"memory probe exited {proc.returncode}: {last}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build(name: str, workload: Workload, options: CaseOptions) -> tuple[Case | None, dict]:
    """The case, or None and its record when it cannot run here."""
    record = {"name": name, "kind": CASES[name][0], "status": "ok", "reason": None}
    try:
        return build_case(name, workload, options), record
    except Unavailable as error:
        return None, {**record, "status": "unavailable", "reason": f"unavailable: {error}"}
    except Exception as error:  # a baseline that breaks must not take the others down
        return None, {**record, "status": "error", "reason": f"build failed: {type(error).__name__}: {error}"}


def run_case(
    name: str,
    config: BenchConfig,
    workload: Workload,
    reference: float,
    peak: Peak,
    timing: Timing | None = None,
    case: Case | None = None,
) -> dict:
    """Times (unless `timing` is given) and measures one case, and derives its record."""
    device = torch.device(config.device)
    if case is None:
        case, record = build(name, workload, config.options)
        if case is None:
            return record
    else:
        record = {"name": name, "kind": CASES[name][0], "status": "ok", "reason": None}
    kind = record["kind"]
    try:
        if timing is None:
            timing = time_step(case, device, config.warmup, config.reps)
        if device.type == "cuda":
            memory = {"status": "ok", "peak_extra_bytes": cuda_peak_extra_bytes(case)}
            method = "torch.cuda.max_memory_allocated - memory_allocated before the step"
        elif config.cpu_memory:
            memory = probe_cpu_memory(config, name)
            method = "VmHWM - VmRSS around one step, fresh subprocess per case, MALLOC_MMAP_THRESHOLD_=65536"
        else:
            memory, method = {"status": "ok", "peak_extra_bytes": None}, "not measured (--no-cpu-memory)"
    except Exception as error:
        return {**record, "status": "error", "reason": f"run failed: {type(error).__name__}: {error}"}
    finally:
        del case
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not torch.isfinite(torch.tensor(timing.loss)):
        return {**record, "status": "error", "reason": f"non-finite loss {timing.loss}"}
    if memory["status"] != "ok":
        return {**record, "status": memory["status"], "reason": f"memory: {memory['reason']}"}

    s = config.shape
    itemsize = torch.empty((), dtype=s.torch_dtype).element_size()
    if kind == "logits":
        floors = logits_floors(s.num_tokens, s.vocab, itemsize, peak)
        achieved = {"achieved_tbps_kernel_traffic_model": floors.kernel_traffic_bytes / (timing.median_ms * 1e9)}
    else:
        floors = linear_floors(s.num_tokens, s.vocab, s.hidden, itemsize, peak)
        achieved = {"achieved_tflops": floors.flops / (timing.median_ms * 1e9)}
        if config.measured_tflops:
            floor_ms = floors.flops / (config.measured_tflops * 1e9)
            achieved["floor_ms_at_measured_matmul"] = floor_ms
            achieved["percent_of_measured_matmul_floor"] = percent_of_floor(floor_ms, timing.median_ms)
    return {
        **record,
        "median_ms": timing.median_ms,
        "min_ms": timing.min_ms,
        "max_ms": timing.max_ms,
        "reps": timing.reps,
        "peak_extra_bytes": memory["peak_extra_bytes"],
        "memory_method": method,
        "loss": timing.loss,
        "loss_abs_diff_vs_reference": abs(timing.loss - reference),
        "floor_ms": floors.floor_ms,
        "percent_of_floor": percent_of_floor(floors.floor_ms, timing.median_ms),
        **achieved,
    }


def interleaved_records(config: BenchConfig, workload: Workload, reference: float, peak: Peak) -> list[dict]:
    """Every case built first and timed in turn, then measured one by one (memory, floors)."""
    device = torch.device(config.device)
    built, records = {}, {}
    for name in config.cases:
        case, record = build(name, workload, config.options)
        if case is None:
            records[name] = record
        else:
            built[name] = case
    try:
        timings = time_steps_interleaved(built, device, config.warmup, config.reps)
    except Exception as error:
        reason = f"run failed: {type(error).__name__}: {error}"
        timings = {}
        for name in built:
            records[name] = {"name": name, "kind": CASES[name][0], "status": "error", "reason": reason}
    for name in list(built):
        case = built.pop(name)
        if name in timings:
            records[name] = run_case(name, config, workload, reference, peak, timing=timings[name], case=case)
        del case
    return [records[name] for name in config.cases]


def host_load() -> dict:
    """What shares the machine: CPU threads torch uses, the OpenMP settings, the load average."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_1_5_15": list(load) if load else None,
        **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
    }


def run(config: BenchConfig, argv: list[str] | None = None) -> tuple[dict, Path]:
    device = torch.device(config.device)
    s = config.shape
    git = git_info(REPO)
    name = device_name(device)
    peak = lookup_peak(name, s.dtype, config.peak_tflops, config.peak_tbps)
    itemsize = torch.empty((), dtype=s.torch_dtype).element_size()
    workload = make_workload(s, device, seed=config.seed)
    reference = reference_loss(workload)
    padded_len = max(workload.lengths)
    record = {
        "schema": SCHEMA,
        "name": config.name,
        "complete": False,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": list(argv or []),
        "git": git,
        "device": {"type": device.type, "name": name, "tag": device_tag(device), "peak": asdict(peak)},
        "versions": versions(),
        "env": {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), **host_load()},
        "shape": {
            **asdict(s),
            "valid_tokens": int(workload.loss_mask.sum()),
            "padded_len": padded_len,
            "padding_frac": 1.0 - s.num_tokens / (s.num_seqs * padded_len),
        },
        "settings": {
            "warmup": config.warmup,
            "reps": config.reps,
            "seed": config.seed,
            "interleave": config.interleave,
            **asdict(config.options),
        },
        "floors": {
            "logits": asdict(logits_floors(s.num_tokens, s.vocab, itemsize, peak)),
            "linear": asdict(linear_floors(s.num_tokens, s.vocab, s.hidden, itemsize, peak)),
        },
        "reference_loss": reference,
        "cases": [],
        "summary": {},
    }
    if config.matmul_rate:
        rate = matmul_tflops(s.num_tokens, s.hidden, s.vocab, s.torch_dtype, device)
        config = replace(config, measured_tflops=rate)
        record["matmul"] = {
            "shape_mkn": [s.num_tokens, s.hidden, s.vocab],
            "dtype": s.dtype,
            "tflops": rate,
            "linear_floor_ms": record["floors"]["linear"]["flops"] / (rate * 1e9),
        }
        print(f"matmul [T, H] x [H, V]: {rate:.1f} TFLOP/s", flush=True)
    path = result_path(config.out_dir, config.name, device_tag(device), git["short"])
    if config.interleave:
        results = iter(interleaved_records(config, workload, reference, peak))
    else:
        results = (run_case(case_name, config, workload, reference, peak) for case_name in config.cases)
    for case_record in results:
        record["cases"].append(case_record)
        add_ratios(record["cases"])
        record["summary"] = summarize(record["cases"], on_gpu=device.type == "cuda")
        write_record(record, path)
        print(format_case(record["cases"][-1]), flush=True)
    record["env"]["loadavg_after"] = host_load()["loadavg_1_5_15"]
    record["complete"] = True
    write_record(record, path)
    return record, path


def format_case(case: dict) -> str:
    if case["status"] != "ok":
        return f"{case['name']:<28} {case['status']}: {case['reason']}"
    mem = case["peak_extra_bytes"]
    pct = case["percent_of_floor"]
    return (
        f"{case['name']:<28} {case['median_ms']:9.2f} ms  peak extra "
        f"{'-' if mem is None else f'{mem / 2**20:9.1f} MiB'}  "
        f"{'' if pct is None else f'{pct:5.1f}% of floor  '}loss {case['loss']:.6g}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = parse_args(argv)
    except ValueError as error:
        print(f"bench_grpo_loss: {error}", file=sys.stderr)
        return 2
    record, path = run(config, argv)
    print(json.dumps(record["summary"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
