"""``python -m bench.profile --recipe NAME [--set k=v ...] --steps N [--out DIR]``

Runs N steps of a recipe in one process under ``torch.profiler`` (CPU always, CUDA when present)
and writes into DIR: ``trace.json`` (Chrome / Perfetto), ``breakdown.md`` and ``breakdown.json``
(the trainer's own step-time phases and peak memory per step, with the git commit and device).
The phases are the ones the trainer logs, so the table matches the run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.kernels.report import git_info
from osvl.config import load_recipe
from osvl.trainer.flops import device_name
from osvl.trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
PHASES = {
    "sft": ("time_data_s", "time_forward_backward_s", "time_optimizer_s"),
    "grpo": ("time_rollout_s", "time_tools_s", "time_advantages_s", "time_pack_s", "time_train_s", "time_sync_s"),
}
EXTRA = ("step_time_s", "memory_peak_gib", "model_tflops", "mfu")


def breakdown(stage: str, records: list[dict]) -> list[dict]:
    """Per-step rows of the stage's phases, step time, peak memory, FLOPs and MFU (when known)."""
    if stage not in PHASES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {sorted(PHASES)}")
    keys = ("step", *PHASES[stage], *EXTRA)
    missing = [k for k in (*PHASES[stage], "step_time_s") if records and k not in records[0]]
    if not records or missing:
        raise ValueError(f"metrics have no {missing or 'records'}: was the run logged every step?")
    return [{k: r[k] for k in keys if k in r} for r in records]


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(f"{r.get(k, float('nan')):.4g}" for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run(recipe_name: str, overrides: list[str], steps: int, out: Path) -> dict:
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    recipe = load_recipe(
        recipe_name,
        [
            *overrides,
            f"job.run_dir={out / 'run'}",
            "checkpoint.resume=false",
            "checkpoint.export_hf=false",
            "metrics.log_every=1",
            "metrics.console=false",
        ],
    )
    from osvl.trainer import run_grpo, run_sft

    train = run_grpo if recipe.job.stage == "grpo" else run_sft
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with profile(activities=activities, profile_memory=True, record_shapes=False) as prof:
        train(recipe, stop_after=steps)
    wall = time.perf_counter() - started
    prof.export_chrome_trace(str(out / "trace.json"))
    rows = breakdown(recipe.job.stage, read_metrics(out / "run"))
    result = {
        "recipe": recipe.job.name,
        "stage": recipe.job.stage,
        "overrides": overrides,
        "steps": steps,
        "wall_s": wall,
        "git": git_info(REPO),
        "device": device_name() or "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    (out / "breakdown.json").write_text(json.dumps(result, indent=2))
    (out / "breakdown.md").write_text(
        f"# {recipe.job.name} ({recipe.job.stage}) on {result['device']}, "
        f"commit {result['git']['short']}\n\n" + markdown(rows)
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    args = parser.parse_args(argv)
    try:
        result = run(args.recipe, args.overrides, args.steps, args.out)
    except ValueError as error:
        parser.error(str(error))
    print((args.out / "breakdown.md").read_text())
    print(f"trace: {args.out / 'trace.json'} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
