"""Peak memory of the fused-linear GRPO loss: osvl `linear_grpo_loss` against Liger's chunked
fused-linear GRPO loss, measured with one harness and set beside the analytic accounting.

    python bench/kernels/bench_linear_memory.py                # CUDA: T=16384 H=4096 V=151936 bf16
    python bench/kernels/bench_linear_memory.py --device cpu   # CPU: that shape / 16 in T, H, V

Peaks (gradients included, inputs excluded): CUDA `torch.cuda.max_memory_allocated()` over one
warmed-up step minus `memory_allocated()` before it; CPU the same quantity from torch's CPU
allocator events under the profiler (`measure.cpu_allocated_peak_bytes`). Dividing T, H and V by
one factor keeps every ratio of the accounting (dW : dH : logits chunk : Liger's buffers). On
CPU ours runs the torch backend, whose fp32 token-pass temporaries (Triton writes the gradient
in place, so they do not exist on GPU) appear as their own line of the CPU accounting; its fixed
64 MiB working set is scaled with V·H as well (at least 4 rows at a time). The dW
accumulation error (weight-dtype vs fp32 accumulator, each against float64) is measured at the
real token count. Writes <out-dir>/<name>-<gpu|cpu>-<commit>.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import osvl_kernels.token_pass as token_pass_module  # noqa: E402
from bench.kernels.cases import CaseOptions, Unavailable, build_case  # noqa: E402
from bench.kernels.measure import cpu_allocated_peak_bytes, cuda_peak_extra_bytes  # noqa: E402
from bench.kernels.memory_model import (  # noqa: E402
    Problem,
    liger_peak,
    osvl_fp32_accum_peak,
    osvl_peak,
    returned_gradients_floor,
    table,
    total,
)
from bench.kernels.report import device_name, device_tag, git_info, result_path, versions, write_record  # noqa: E402
from bench.kernels.workload import DTYPES, Shape, make_workload, ppo_clip_token_loss, split_lengths  # noqa: E402
from osvl_kernels import linear_grpo_loss  # noqa: E402
from osvl_kernels.linear_grpo_loss import lm_head_chunk_rows  # noqa: E402

SCHEMA = "osvl.bench.linear_memory/1"
REAL = Shape(num_tokens=16384, vocab=151936, hidden=4096, num_seqs=16, dtype="bf16")
TARGET_RATIO = 0.25  # the target: fused-linear peak <= 1/4 of Liger's
# name -> (case builder name, options on top of the run's)
VARIANTS = {
    "osvl_linear_grpo_loss": ("osvl_linear_grpo_loss", {}),
    "osvl_linear_grpo_loss_fp32_weight_grad": ("osvl_linear_grpo_loss", {"osvl_fp32_weight_grad": True}),
    "liger_fused_linear_grpo": ("liger_fused_linear_grpo", {}),
}


def scaled(shape: Shape, factor: int) -> Shape:
    if factor < 1:
        raise ValueError(f"--scale must be >= 1, got {factor}")
    return replace(
        shape, num_tokens=shape.num_tokens // factor, vocab=shape.vocab // factor, hidden=shape.hidden // factor
    )


def problem_of(shape: Shape, padded_len: int) -> Problem:
    itemsize = torch.empty((), dtype=DTYPES[shape.dtype]).element_size()
    return Problem(shape.num_tokens, shape.hidden, shape.vocab, shape.num_seqs, padded_len, itemsize)


def accounting(shape: Shape, padded_len: int, on_cpu: bool) -> dict:
    """Every buffer live at each implementation's peak, and the floor no implementation beats."""
    p = problem_of(shape, padded_len)
    rows = lm_head_chunk_rows(shape.vocab, shape.hidden, DTYPES[shape.dtype])
    impls = {
        "osvl_linear_grpo_loss": osvl_peak(p, rows, on_cpu),
        "osvl_linear_grpo_loss_fp32_weight_grad": osvl_fp32_accum_peak(p, rows),
        "liger_fused_linear_grpo": liger_peak(p),
    }
    liger = total(impls["liger_fused_linear_grpo"])
    return {
        "problem": asdict(p),
        "chunk_rows": rows,
        "peaks": {name: {"total_bytes": total(b), "buffers": table(b)} for name, b in impls.items()},
        "ratio_vs_liger": {name: total(b) / liger for name, b in impls.items()},
        "returned_gradients_floor_bytes": returned_gradients_floor(p),
        "floor_ratio_vs_liger": returned_gradients_floor(p) / liger,
    }


def real_padded_len(num_seqs: int, seed: int) -> int:
    """The longest sequence make_workload draws at the real token count (Liger pads to it)."""
    return max(split_lengths(REAL.num_tokens, num_seqs, torch.Generator().manual_seed(seed)))


def measure_peak(name: str, workload, options: CaseOptions, device: torch.device) -> dict:
    builder, extra = VARIANTS[name]
    try:
        case = build_case(builder, workload, replace(options, **extra))
    except Unavailable as error:
        return {"status": "unavailable", "reason": str(error)}
    try:
        case.reset()
        case.step()  # warm-up: lazy init, torch.compile
        peak = cuda_peak_extra_bytes(case) if device.type == "cuda" else cpu_allocated_peak_bytes(case)
    except Exception as error:  # a baseline that breaks must not take the others down
        return {"status": "error", "reason": f"{type(error).__name__}: {error}"}
    finally:
        del case
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"status": "ok", "peak_extra_bytes": peak}


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def weight_grad_accumulation_error(
    num_tokens: int, chunk_sizes: list[int], device: torch.device, seed: int = 0
) -> dict:
    """dW error against float64 of the weight-dtype and fp32 accumulators at `num_tokens` tokens,
    on `device`'s GEMMs (small V, H: the error depends on the number of chunks, not on V or H).
    The float64 reference is the workload's objective (PPO clip, seq-mean-token-mean) under
    autograd on the same bf16-rounded hidden and weight."""
    shape = Shape(num_tokens=num_tokens, vocab=512, hidden=64, num_seqs=16, dtype="bf16")
    w = make_workload(shape, device, seed=seed)
    inputs = {
        "target_ids": w.target_ids,
        "cu_seqlens": w.cu_seqlens,
        "loss_mask": w.loss_mask,
        "old_logprobs": w.old_logprobs,
        "advantages": w.advantages,
    }
    weight64 = w.weight.double().requires_grad_()
    logp = torch.log_softmax(w.hidden.double() @ weight64.T, dim=-1).gather(1, w.target_ids[:, None]).squeeze(1)
    advantage = torch.repeat_interleave(w.advantages.double(), torch.tensor(w.lengths, device=device))
    (ppo_clip_token_loss(logp, w.old_logprobs.double(), advantage) * w.token_weight.double()).sum().backward()
    ref = weight64.grad
    out = {
        "shape": asdict(shape),
        "bf16_rounding_of_exact_rel_err": relative_error(ref.to(torch.bfloat16), ref),
        "by_chunk_size": [],
    }
    for chunk in chunk_sizes:
        errors = {}
        for label, accum in (("weight_dtype_accum_rel_err", None), ("fp32_accum_rel_err", torch.float32)):
            weight = w.weight.clone().requires_grad_()
            loss = linear_grpo_loss(
                w.hidden,
                weight,
                **inputs,
                chunk_size=chunk,
                grad_weight_accum_dtype=accum,
                backend="auto" if device.type == "cuda" else "torch",
            ).loss
            loss.backward()
            errors[label] = relative_error(weight.grad, ref)
        out["by_chunk_size"].append({"chunk_size": chunk, "chunks": -(-num_tokens // chunk), **errors})
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--scale", type=int, help="divide T, H and V of the real shape by this (default: 1 CUDA, 16 CPU)")
    p.add_argument("--seqs", type=int, default=REAL.num_seqs)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--numerics-tokens", type=int, default=REAL.num_tokens, help="T of the dW error measurement (0: skip)"
    )
    p.add_argument("--name", default="linear_memory")
    p.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or REPO / "bench" / "results"))
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device (use --device cpu)")
    if a.scale is None:
        a.scale = 1 if a.device == "cuda" else 16
    if a.numerics_tokens < 0:
        raise ValueError(f"--numerics-tokens must be >= 0, got {a.numerics_tokens}")
    a.shape = replace(scaled(REAL, a.scale), num_seqs=a.seqs)
    return a


def run(a: argparse.Namespace, argv: list[str]) -> tuple[dict, Path]:
    device = torch.device(a.device)
    shape = a.shape
    torch_budget = token_pass_module.TORCH_CHUNK_BYTES
    if device.type == "cpu":  # the torch backend's working set scales with V·H too (>= 4 rows at a time)
        token_pass_module.TORCH_CHUNK_BYTES = max(torch_budget // a.scale**2, 3 * 4 * 4 * shape.vocab)
    workload = make_workload(shape, device, seed=a.seed)
    padded_len = max(workload.lengths)
    options = CaseOptions(
        osvl_backend="auto" if device.type == "cuda" else "torch", liger_compiled=device.type == "cuda"
    )
    git = git_info(REPO)
    record = {
        "schema": SCHEMA,
        "name": a.name,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": argv,
        "git": git,
        "device": {"type": device.type, "name": device_name(device), "tag": device_tag(device)},
        "versions": versions(),
        "shape": {**asdict(shape), "padded_len": padded_len, "scale_of_real_shape": a.scale},
        "settings": {**asdict(options), "torch_backend_working_set_bytes": token_pass_module.TORCH_CHUNK_BYTES},
        "method": (
            "torch.cuda.max_memory_allocated - memory_allocated before one warmed-up step"
            if device.type == "cuda"
            else "torch CPU allocator events under torch.profiler(profile_memory=True): "
            "peak running sum over one warmed-up step"
        ),
        "cases": {},
    }
    for name in VARIANTS:
        record["cases"][name] = measure_peak(name, workload, options, device)
        print(name, record["cases"][name], flush=True)
    model_here = accounting(shape, padded_len, on_cpu=device.type == "cpu")
    token_pass_module.TORCH_CHUNK_BYTES = torch_budget
    peaks = {k: v.get("peak_extra_bytes") for k, v in record["cases"].items()}
    liger = peaks["liger_fused_linear_grpo"]
    ratios = {k: (v / liger if v is not None and liger else None) for k, v in peaks.items()}
    record["ratio_vs_liger"] = ratios
    record["model"] = {
        "this_shape": model_here,
        "real_shape": accounting(REAL, real_padded_len(shape.num_seqs, a.seed), on_cpu=False),
        "measured_over_model": {
            k: (peaks[k] / model_here["peaks"][k]["total_bytes"] if peaks[k] is not None else None) for k in VARIANTS
        },
    }
    ours = ratios["osvl_linear_grpo_loss"]
    record["target"] = {
        "peak_ratio_vs_liger": f"<= {TARGET_RATIO}",
        "measured": ours,
        "met": (ours <= TARGET_RATIO) if ours is not None and device.type == "cuda" else None,
        "floor_ratio_vs_liger_real_shape": record["model"]["real_shape"]["floor_ratio_vs_liger"],
        "note": "the gradients every implementation returns (dW [V,H] + dH [T,H]) are the floor",
    }
    if a.numerics_tokens:
        rows = lm_head_chunk_rows(REAL.vocab, REAL.hidden, DTYPES[REAL.dtype])
        chunks = sorted({rows // 2, rows, rows * 2})
        record["weight_grad_accumulation_error"] = weight_grad_accumulation_error(
            a.numerics_tokens, chunks, device, a.seed
        )
    path = result_path(a.out_dir, a.name, device_tag(device), git["short"])
    write_record(record, path)
    return record, path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
    except ValueError as error:
        print(f"bench_linear_memory: {error}", file=sys.stderr)
        return 2
    record, path = run(a, argv)
    print("ratio vs liger:", record["ratio_vs_liger"])
    print("model ratio vs liger (this shape):", record["model"]["this_shape"]["ratio_vs_liger"])
    print("model ratio vs liger (real shape):", record["model"]["real_shape"]["ratio_vs_liger"])
    print("floor (real shape):", record["target"]["floor_ratio_vs_liger_real_shape"])
    if "weight_grad_accumulation_error" in record:
        print("dW error:", record["weight_grad_accumulation_error"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
