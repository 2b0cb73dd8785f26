"""Back-pressure: healthy calls from many concurrent callers into a saturated tool server.

    python bench/tools/bench_overload.py                  # 56 callers x 4 calls, 4 workers, queue 16
    python bench/tools/bench_overload.py --callers 56 --calls 4 --workers 4 --queue 16 --call-s 0.2

A tool server process (this file run with ``--serve``: ``--workers`` workers, ``--queue`` calls waiting,
one tool that sleeps ``--call-s`` and echoes its tag) takes ``--callers`` concurrent callers, each
making ``--calls`` calls in turn, once per client mode:

- ``one_request``: one request per call, what the client did before it waited out overload (a 503
  ``overloaded`` answer was the call's ``infra_error`` at once);
- ``waits_out_overload``: ``RemoteToolPool.call``, which asks again after the server's estimate until
  the call's deadline (``--deadline-s``).

Reported per mode: calls answered ``ok``, ``infra_error`` (of them ``overloaded``), the overload answers
the calls met, the calls the server ran (none lost or run twice: ran == ok), p50/p99/max latency.
Writes <out-dir>/overload-cpu-<commit>.json with the git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from bench.kernels.report import git_info  # noqa: E402
from osvl.rl.trajectory import ToolResult, ToolStatus  # noqa: E402
from osvl.tools import Job  # noqa: E402
from osvl.tools.client import RemoteToolPool  # noqa: E402
from osvl.tools.registry import ToolOutput, ToolSpec  # noqa: E402

SCHEMA = "osvl.bench.overload/1"
MODES = ("one_request", "waits_out_overload")
TARGET = "bench.tools.bench_overload:pause"


def pause(arguments, images, config) -> ToolOutput:
    """The healthy call: it takes a while and never fails."""
    time.sleep(float(arguments.get("seconds", 0.0)))
    return ToolOutput(text=f"done:{arguments.get('tag', '')}")


def serve(ready: Path, workers: int, queue: int) -> None:
    """The tool server process: one ``pause`` tool, ``workers`` workers, ``queue`` calls waiting."""
    import threading

    from osvl.tools import PoolConfig, ToolBackendsConfig, ToolPool, ToolRegistry
    from osvl.tools.server import ToolServer

    spec = ToolSpec(
        name="pause",
        description="sleep, then echo the tag",
        parameters={
            "type": "object",
            "properties": {"tag": {"type": "string", "maxLength": 64}, "seconds": {"type": "number", "minimum": 0}},
        },
        target=TARGET,
        deadline_s=60.0,
    )
    registry = ToolRegistry([spec])
    config = PoolConfig(num_workers=workers, max_queue=queue, preload=registry.targets())
    with ToolPool(ToolBackendsConfig(), config) as pool:
        server = ToolServer(registry, pool).start()
        tmp = ready.with_suffix(".tmp")
        tmp.write_text(server.url)
        tmp.replace(ready)
        threading.Event().wait()


@dataclass
class ModeResult:
    mode: str
    calls: int
    ok: int
    infra_error: int
    overloaded: int  # infra errors because the deadline passed while the server stayed overloaded
    other: int  # any other status (none expected: the calls are healthy)
    overload_answers: int  # 503 overloaded answers the calls met
    calls_met_overload: int
    server_ran: int  # calls the server's pool completed during the mode
    ok_frac: float
    p50_s: float
    p99_s: float
    max_s: float
    wall_s: float


def _one_request(client: RemoteToolPool, job: Job) -> ToolResult:
    outcome = client.attempt(job, None)
    if isinstance(outcome, ToolResult):
        return outcome
    return ToolResult(ToolStatus.INFRA_ERROR, job.tool, error=f"tool server failed: HTTP 503: {outcome.message}")


def run_mode(
    url: str, mode: str, callers: int, calls: int, call_s: float, deadline_s: float
) -> tuple[ModeResult, list[float]]:
    client = RemoteToolPool(url)
    ask = client.call if mode == "waits_out_overload" else lambda job: _one_request(client, job)

    def caller(index: int) -> list[tuple[ToolResult, float]]:
        out = []
        for n in range(calls):
            job = Job("pause", TARGET, {"tag": f"{index}.{n}", "seconds": call_s}, deadline_s=deadline_s)
            started = time.perf_counter()
            result = ask(job)
            out.append((result, time.perf_counter() - started))
        return out

    ran_before = httpx.get(f"{url}/v1/stats", timeout=30).json()["completed"]
    started = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        done = [pair for part in pool.map(caller, range(callers)) for pair in part]
    wall = time.perf_counter() - started
    ran = httpx.get(f"{url}/v1/stats", timeout=30).json()["completed"] - ran_before
    client.close()
    results, latencies = [r for r, _ in done], [s for _, s in done]
    ok = sum(r.status is ToolStatus.OK for r in results)
    infra = sum(r.status is ToolStatus.INFRA_ERROR for r in results)
    lat = np.asarray(latencies)
    summary = ModeResult(
        mode=mode,
        calls=len(results),
        ok=ok,
        infra_error=infra,
        overloaded=sum(r.overloaded for r in results),
        other=len(results) - ok - infra,
        overload_answers=sum(r.overloads for r in results)
        + (infra if mode == "one_request" else 0),  # there every infra error was an overload answer
        calls_met_overload=sum(r.overloads > 0 for r in results) + (infra if mode == "one_request" else 0),
        server_ran=ran,
        ok_frac=ok / max(len(results), 1),
        p50_s=float(np.percentile(lat, 50)),
        p99_s=float(np.percentile(lat, 99)),
        max_s=float(lat.max()),
        wall_s=wall,
    )
    return summary, latencies


def start_server(workers: int, queue: int, folder: Path) -> tuple[subprocess.Popen, str]:
    ready = folder / "url"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels")])}
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(ready)]
    command += ["--workers", str(workers), "--queue", str(queue)]
    process = subprocess.Popen(command, cwd=REPO, env=env)
    deadline = time.monotonic() + 300
    while not ready.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the tool server did not start (exit code {process.poll()})")
        time.sleep(0.1)
    return process, ready.read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=56)
    parser.add_argument("--calls", type=int, default=4, help="calls per caller, one after the other")
    parser.add_argument("--workers", type=int, default=4, help="the server's tool workers")
    parser.add_argument("--queue", type=int, default=16, help="the server's queue of waiting calls")
    parser.add_argument("--call-s", type=float, default=0.2, help="how long each healthy call runs")
    parser.add_argument("--deadline-s", type=float, default=20.0, help="each call's own deadline")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "tools" / "results")
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.workers, args.queue)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    git = git_info(REPO)
    load_before = os.getloadavg()[0]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="osvl-overload-") as folder:
        process, url = start_server(args.workers, args.queue, Path(folder))
        try:
            for mode in modes:
                summary, _ = run_mode(url, mode, args.callers, args.calls, args.call_s, args.deadline_s)
                results.append(asdict(summary))
                print(json.dumps(results[-1]), flush=True)
        finally:
            process.kill()
            process.wait(30)
    record = {
        "schema": SCHEMA,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "host": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": os.getloadavg()[0],
        },
        "config": {
            "callers": args.callers,
            "calls_per_caller": args.calls,
            "workers": args.workers,
            "queue": args.queue,
            "call_s": args.call_s,
            "deadline_s": args.deadline_s,
        },
        "results": results,
    }
    path = args.out_dir / f"overload-cpu-{str(git['commit'])[:12]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
