"""Child process for CPU memory: build one case, warm it up, print its peak extra RSS as JSON.

A fresh process per case keeps one case's freed memory and lazy initialisation out of
another's measurement. Run by `bench_grpo_loss.py`; usable alone:
    python -m bench.kernels.rss_probe '{"case": "torch_eager", "shape": {...}, "options": {}, "seed": 0}'
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import torch

from bench.kernels.cases import CaseOptions, Unavailable, build_case
from bench.kernels.measure import rss_peak_extra_bytes
from bench.kernels.workload import Shape, make_workload


def probe(spec: dict) -> dict:
    shape = Shape(**spec["shape"])
    workload = make_workload(shape, "cpu", seed=spec.get("seed", 0))
    try:
        case = build_case(spec["case"], workload, CaseOptions(**spec.get("options", {})))
    except Unavailable as error:
        return {"status": "unavailable", "reason": str(error)}
    case.reset()
    case.step()  # warm-up: lazy init, torch.compile, interpreter set-up
    return {"status": "ok", "peak_extra_bytes": rss_peak_extra_bytes(case), "shape": asdict(shape)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.kernels.rss_probe '<json spec>'", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(json.dumps(probe(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
