"""Throughput and latency of every built-in tool: in-process baseline vs the worker pool.

    python bench/tools/bench_tools.py                       # all tools, 1 and 2 workers
    python bench/tools/bench_tools.py --tools crop,ocr --calls 20 --concurrency 4

For each tool the same inputs run (a) in this process through ``run_job`` (the baseline: no IPC,
no process boundary) and (b) through a ``ToolPool`` of 1 and of 2 spawned workers, with
``--concurrency`` callers in flight (pool latencies include queueing behind them). Reported per
case: calls/s, p50/p99/mean latency; ratios: pool over in-process calls/s and p50 (the price of
isolation), 2-worker over 1-worker calls/s (scaling). OpenCV runs one thread per worker and in the
in-process baseline alike.

Inputs are generated here (rendered text, synthetic scenes, a synthetic corpus); offline backends
only. Writes <out-dir>/tools-cpu-<commit>.json after every case (``"complete": false`` until the
last), with the git commit and whether osvl/tools had uncommitted changes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

import cv2  # noqa: E402
import numpy as np  # noqa: E402

from bench.kernels.report import git_info  # noqa: E402
from osvl.tools import ImageSearchConfig, Job, PoolConfig, TextSearchConfig, ToolBackendsConfig, ToolPool  # noqa: E402
from osvl.tools.catalog import default_registry  # noqa: E402
from osvl.tools.image_io import encode_png  # noqa: E402
from osvl.tools.worker import run_job  # noqa: E402

SCHEMA = "osvl.bench.tools/1"
ALL_TOOLS = ("crop", "sharpen", "perspective_correct", "super_resolution", "ocr", "text_search", "image_search")


@dataclass
class CaseResult:
    tool: str
    mode: str  # inprocess | pool
    workers: int
    calls: int
    concurrency: int
    calls_per_s: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    errors: int


def document(width: int = 640) -> np.ndarray:
    lines = ["QUARTERLY REPORT", "Revenue rose 12 percent", "Net margin 7.5 percent", "Outlook stable"]
    image = np.full((60 * len(lines) + 60, width, 3), 255, np.uint8)
    for i, line in enumerate(lines):
        cv2.putText(image, line, (30, 72 + 60 * i), cv2.FONT_HERSHEY_SIMPLEX, 1.1, (0, 0, 0), 2, cv2.LINE_AA)
    return image


def scene(seed: int, size: tuple[int, int] = (320, 400)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    image = np.zeros((*size, 3), np.uint8)
    image[:] = rng.integers(0, 255, size=3)
    for _ in range(10):
        colour = tuple(int(c) for c in rng.integers(0, 255, size=3))
        p1 = (int(rng.integers(0, size[1])), int(rng.integers(0, size[0])))
        p2 = (int(rng.integers(0, size[1])), int(rng.integers(0, size[0])))
        cv2.rectangle(image, p1, p2, colour, -1)
    return image


def skewed(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    source = np.float32([[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]])
    target = np.float32([[80, 30], [w + 60, 80], [w + 40, h + 60], [30, h + 20]])
    canvas = np.full((h + 120, w + 120, 3), 60, np.uint8)
    return cv2.warpPerspective(
        image,
        cv2.getPerspectiveTransform(source, target),
        (w + 120, h + 120),
        dst=canvas,
        borderMode=cv2.BORDER_TRANSPARENT,
    )


def build_world(folder: Path, documents: int) -> ToolBackendsConfig:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(5000)]
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as handle:
        for i in range(documents):
            text = ". ".join(" ".join(rng.choice(words, 12)) for _ in range(8)) + "."
            handle.write(json.dumps({"id": str(i), "title": f"Page {i}", "text": text}) + "\n")
    with open(folder / "collection.jsonl", "w", encoding="utf-8") as handle:
        for i in range(20):
            (folder / f"{i}.png").write_bytes(encode_png(scene(i)))
            handle.write(json.dumps({"image": f"{i}.png", "title": f"Entity {i}", "page_id": str(i)}) + "\n")
    return ToolBackendsConfig(
        text_search=TextSearchConfig(corpus_path=str(folder / "corpus.jsonl")),
        image_search=ImageSearchConfig(collection_path=str(folder / "collection.jsonl")),
    )


def workloads() -> dict[str, tuple[dict[str, object], list[np.ndarray]]]:
    doc = document()
    small = cv2.resize(doc, (doc.shape[1] // 4, doc.shape[0] // 4), interpolation=cv2.INTER_AREA)
    photo = cv2.resize(scene(7), (300, 240))
    return {
        "crop": ({"image": 0, "boxes": [[10, 10, 300, 200], [100, 50, 400, 300]]}, [scene(1)]),
        "sharpen": ({"image": 0}, [cv2.GaussianBlur(doc, (0, 0), 2)]),
        "perspective_correct": ({"image": 0}, [skewed(doc)]),
        "super_resolution": ({"image": 0, "scale": 2}, [small]),
        "ocr": ({"image": 0}, [doc]),
        "text_search": ({"query": "w17 w230 w4999"}, []),
        "image_search": ({"image": 0}, [photo]),
    }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q))


def summarise(
    tool: str, mode: str, workers: int, concurrency: int, latencies: list[float], wall: float, errors: int
) -> CaseResult:
    return CaseResult(
        tool,
        mode,
        workers,
        len(latencies),
        concurrency,
        len(latencies) / wall,
        percentile(latencies, 50),
        percentile(latencies, 99),
        float(np.mean(latencies) * 1000),
        errors,
    )


def bench_inprocess(tool: str, arguments: dict, images: list, config: ToolBackendsConfig, calls: int) -> CaseResult:
    target = default_registry().get(tool).target
    arguments = default_registry().parse({"name": tool, "arguments": arguments}).arguments  # defaults filled
    status, _, _, error = run_job(target, arguments, images, config)  # warm-up: model loading is not per call
    if status.value != "ok":
        raise RuntimeError(f"{tool} fails on its benchmark input: {status.value}: {error}")
    latencies, errors = [], 0
    start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        status, _, _, _ = run_job(target, arguments, images, config)
        latencies.append(time.perf_counter() - t0)
        errors += status.value != "ok"
    return summarise(tool, "inprocess", 0, 1, latencies, time.perf_counter() - start, errors)


def bench_pool(pool: ToolPool, tool: str, arguments: dict, images: list, calls: int, concurrency: int) -> CaseResult:
    spec = default_registry().get(tool)
    filled = default_registry().parse({"name": tool, "arguments": arguments}).arguments
    make = lambda: Job(tool, spec.target, filled, images, deadline_s=spec.deadline_s * 4)  # noqa: E731

    async def run() -> tuple[list[float], int, float]:
        await asyncio.gather(*(pool.acall(make()) for _ in range(2 * pool.config.num_workers)))  # warm every worker
        gate = asyncio.Semaphore(concurrency)
        latencies: list[float] = []
        errors = 0

        async def one() -> None:
            nonlocal errors
            async with gate:
                t0 = time.perf_counter()
                result = await pool.acall(make())
                latencies.append(time.perf_counter() - t0)
                errors += not result.ok

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        return latencies, errors, time.perf_counter() - start

    latencies, errors, wall = asyncio.run(run())
    return summarise(tool, "pool", pool.config.num_workers, concurrency, latencies, wall, errors)


def ratios(results: list[CaseResult]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for tool in {r.tool for r in results}:
        by = {(r.mode, r.workers): r for r in results if r.tool == tool}
        entry = {}
        base = by.get(("inprocess", 0))
        for workers in (1, 2):
            if base and ("pool", workers) in by:
                entry[f"pool{workers}_p50_over_inprocess_p50"] = by[("pool", workers)].p50_ms / base.p50_ms
                entry[f"pool{workers}_calls_per_s_over_inprocess"] = (
                    by[("pool", workers)].calls_per_s / base.calls_per_s
                )
        if ("pool", 1) in by and ("pool", 2) in by:
            entry["pool2_over_pool1_calls_per_s"] = by[("pool", 2)].calls_per_s / by[("pool", 1)].calls_per_s
        table[tool] = entry
    return table


def write(path: Path, meta: dict, results: list[CaseResult], complete: bool) -> None:
    record = {**meta, "complete": complete, "results": [asdict(r) for r in results], "ratios": ratios(results)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default=",".join(ALL_TOOLS))
    parser.add_argument("--calls", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--documents", type=int, default=2000, help="offline text corpus size")
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "tools" / "results")
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(tools) - set(ALL_TOOLS))
    if unknown or args.calls < 1 or args.concurrency < 1:
        parser.error(f"unknown tools {unknown}" if unknown else "--calls and --concurrency must be >= 1")
    worker_counts = [int(w) for w in args.workers.split(",")]
    cv2.setNumThreads(1)  # the in-process baseline gets what one pool worker gets (PoolConfig.opencv_threads)
    git = git_info(REPO)
    meta = {
        "schema": SCHEMA,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "config": {
            "tools": tools,
            "calls": args.calls,
            "concurrency": args.concurrency,
            "workers": worker_counts,
            "documents": args.documents,
        },
    }
    path = args.out_dir / f"tools-cpu-{str(git['commit'])[:12]}.json"
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory() as folder:
        config = build_world(Path(folder), args.documents)
        cases = workloads()
        for tool in tools:
            results.append(bench_inprocess(tool, *cases[tool], config, args.calls))
            print(json.dumps(asdict(results[-1])), flush=True)
            write(path, meta, results, complete=False)
        for workers in worker_counts:
            with ToolPool(config, PoolConfig(num_workers=workers, max_queue=4 * args.concurrency)) as pool:
                for tool in tools:
                    results.append(bench_pool(pool, tool, *cases[tool], args.calls, args.concurrency))
                    print(json.dumps(asdict(results[-1])), flush=True)
                    write(path, meta, results, complete=False)
    write(path, meta, results, complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
