"""Per-call overhead of python_interpreter's OS boundary: namespaces vs the old audit-hook-only child.

    python bench/tools/bench_sandbox.py                  # 40 calls per case
    python bench/tools/bench_sandbox.py --calls 100 --workloads pass,numpy

Backends run round-robin in this one process (call i of every backend before call i+1 of any), so
background load on a shared machine lands on all of them alike. Cases: ``unsafe_no_boundary`` (the
old sandbox: a child interpreter with rlimits and the audit hook; the baseline), ``namespaces``
(bubblewrap + seccomp + rlimits + the hook: the default), ``namespaces_no_hook`` (the OS boundary
alone), plus ``bare_python`` (``python -I -S -c pass`` through ``subprocess.run``: the floor no
sandbox can go under). Workloads: ``pass`` (pure overhead), ``print`` (a small computation),
``numpy`` (importing numpy and solving a 2x2 system). Reported per case: p50/p99/mean latency in ms,
and per workload the ratio and the difference of each backend's p50 to the baseline's. Writes
<out-dir>/sandbox-cpu-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.kernels.report import git_info  # noqa: E402
from osvl.tools.sandbox import SandboxConfig, SandboxLimits, run_sandboxed  # noqa: E402

SCHEMA = "osvl.bench.sandbox/1"
BASELINE = "unsafe_no_boundary"
BACKENDS = {
    "unsafe_no_boundary": SandboxConfig(backend="unsafe_no_boundary"),
    "namespaces": SandboxConfig(),
    "namespaces_no_hook": SandboxConfig(audit_hook=False),
}
WORKLOADS = {
    "pass": "pass",
    "print": "print(sum(i * i for i in range(1000)))",
    "numpy": "import numpy as np\nprint(np.linalg.solve(np.array([[2.0, 0.0], [0.0, 4.0]]), np.ones(2)))",
}
LIMITS = SandboxLimits(cpu_s=10, wall_s=30.0)


@dataclass
class Case:
    backend: str
    workload: str
    calls: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    errors: int


def bare_python() -> str | None:
    """The floor: starting the same interpreter with nothing around it."""
    done = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], capture_output=True, check=False)
    return None if done.returncode == 0 else done.stderr.decode()[-200:]


def one_call(backend: str, code: str) -> str | None:
    """The error of one call (None when it ran cleanly)."""
    if backend == "bare_python":
        return bare_python()
    return run_sandboxed(code, LIMITS, BACKENDS[backend]).error


def summarise(backend: str, workload: str, seconds: list[float], errors: int) -> Case:
    ms = np.asarray(seconds) * 1000.0
    return Case(
        backend,
        workload,
        len(seconds),
        float(np.percentile(ms, 50)),
        float(np.percentile(ms, 99)),
        float(ms.mean()),
        errors,
    )


def measure(workload: str, backends: list[str], calls: int) -> list[Case]:
    code = WORKLOADS[workload]
    for backend in backends:  # warm-up: page cache, the seccomp program, the interpreter's own caches
        error = one_call(backend, code)
        if error is not None:
            raise RuntimeError(f"{backend} fails the {workload} workload: {error}")
    seconds: dict[str, list[float]] = {b: [] for b in backends}
    errors = dict.fromkeys(backends, 0)
    for _ in range(calls):
        for backend in backends:
            started = time.perf_counter()
            errors[backend] += one_call(backend, code) is not None
            seconds[backend].append(time.perf_counter() - started)
    return [summarise(b, workload, seconds[b], errors[b]) for b in backends]


def ratios(cases: list[Case]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for workload in dict.fromkeys(c.workload for c in cases):
        by = {c.backend: c for c in cases if c.workload == workload}
        if BASELINE not in by:
            continue
        base = by[BASELINE].p50_ms
        table[workload] = {}
        for backend, case in by.items():
            if backend != BASELINE:
                table[workload][f"{backend}_p50_over_{BASELINE}_p50"] = case.p50_ms / base
                table[workload][f"{backend}_p50_minus_{BASELINE}_p50_ms"] = case.p50_ms - base
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--backends", default=",".join([*BACKENDS, "bare_python"]))
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "tools" / "results")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(workloads) - set(WORKLOADS)) + sorted(set(backends) - {*BACKENDS, "bare_python"})
    if unknown or args.calls < 1:
        parser.error(f"unknown workloads or backends {unknown}" if unknown else "--calls must be >= 1")
    git = git_info(REPO)
    cases: list[Case] = []
    for workload in workloads:
        measured = [b for b in backends if b != "bare_python" or workload == "pass"]
        cases += measure(workload, measured, args.calls)
        for case in cases[-len(measured) :]:
            print(json.dumps(asdict(case)), flush=True)
    record = {
        "schema": SCHEMA,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "host": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "config": {"calls": args.calls, "workloads": workloads, "backends": backends},
        "results": [asdict(c) for c in cases],
        "ratios": ratios(cases),
    }
    path = args.out_dir / f"sandbox-cpu-{str(git['commit'])[:12]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(json.dumps(record["ratios"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
