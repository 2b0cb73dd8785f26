"""Packed GQA attention on CPU: SDPA with ``enable_gqa`` vs ``packed_attention`` (KV heads copied).

CPU SDPA has no fused kernel for grouped KV heads, so ``enable_gqa=True`` runs the unfused math
path; ``osvl.model.attention.packed_attention`` copies each KV head to its query group first and
keeps the fused one. Both run forward + backward on the same packed row in the same process;
the ratio is the result. FLOPs floor per layer: 4 * sum(L_d^2) * Nq * H (causal halves it).

    python -m bench.model.bench_attention [--out bench/model/results/attention-cpu.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernels.report import git_info
from osvl.model.attention import packed_attention, packed_metadata

SCHEMA = "osvl.bench.attention/1"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    docs: int = 13
    doc_len: int = 317  # the demo's pretraining documents
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16  # the tiny preset
    seed: int = 0


def sdpa_enable_gqa(q, k, v, bounds):
    """The baseline: per-document SDPA letting the kernel broadcast KV heads."""
    outs = [F.scaled_dot_product_attention(*(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                           enable_gqa=True).transpose(0, 1) for s, e in itertools.pairwise(bounds)]
    return torch.cat(outs)


def _time(fn, q, k, v, repeats: int) -> float:
    times = []
    for trial in range(repeats + 1):  # the first call warms up
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        if trial:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(w: Workload, repeats: int) -> dict:
    torch.manual_seed(w.seed)
    total = w.docs * w.doc_len
    q, k, v = (torch.randn(total, n, w.head_dim, requires_grad=True) for n in (w.q_heads, w.kv_heads, w.kv_heads))
    cu = torch.arange(0, total + 1, w.doc_len, dtype=torch.int32)
    meta = packed_metadata(cu, total)
    baseline = _time(lambda *t: sdpa_enable_gqa(*t, meta.cu_seq_q_host), q, k, v, repeats)
    ours = _time(lambda *t: packed_attention(*t, meta, causal=True, scale=None, backend="sdpa"), q, k, v, repeats)
    flops = 4 * w.docs * w.doc_len ** 2 * w.q_heads * w.head_dim * 3 / 2  # fwd + 2x bwd, causal half
    return {"schema": SCHEMA, "git": git_info(REPO), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "workload": vars(w) | {"repeats": repeats}, "flops_fwd_bwd": flops,
            "enable_gqa": {"step_s": baseline}, "packed_attention": {"step_s": ours},
            "speedup_packed_over_enable_gqa": baseline / ours}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/model/results/attention-cpu.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--docs", type=int, default=Workload.docs)
    parser.add_argument("--doc-len", type=int, default=Workload.doc_len)
    args = parser.parse_args(argv)
    if min(args.repeats, args.docs, args.doc_len) < 1:
        raise ValueError("--repeats, --docs and --doc-len must be >= 1")
    result = run(Workload(docs=args.docs, doc_len=args.doc_len), args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("enable_gqa", "packed_attention", "speedup_packed_over_enable_gqa")}))
    return result


if __name__ == "__main__":
    main()
