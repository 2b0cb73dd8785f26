"""``python -m osvl.report RUN_DIR``: PNG plots of a run's ``metrics.jsonl`` (headless, Agg).

One figure per panel (loss, reward parts, accuracy, groups that carry a gradient, fatal/clamped,
policy-drift terms, throughput, step-time breakdown, memory); a panel is drawn when the run logged
any of its metrics, so the same command serves SFT and GRPO runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from osvl.trainer.metrics import read_metrics

PANELS: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "grad_norm"),
    "reward": ("reward", "reward_fmt", "reward_acc", "reward_query"),
    "accuracy": ("accuracy", "grounded"),
    "signal": ("signal_groups", "accuracy_signal_groups"),
    "fatal": ("fatal_rate", "clamped_frac"),
    "policy": ("clip_frac", "kl", "entropy", "logprob_abs_diff"),
    "throughput": ("tokens_per_s",),
    "step_time": (
        "time_rollout_s",
        "time_tools_s",
        "time_advantages_s",
        "time_pack_s",
        "time_train_s",
        "time_sync_s",
        "step_time_s",
    ),
    "memory": ("memory_peak_gib",),
    "lr": ("lr",),
}


def render(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Writes ``<panel>.png`` for every panel the run has data for; returns the files written."""
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no records")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, keys in PANELS.items():
        present = [k for k in keys if any(k in r for r in records)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in present:
            points = [(r["step"], r[key]) for r in records if key in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=key)
        ax.set_xlabel("step")
        ax.set_title(f"{Path(run_dir).name}: {panel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{panel}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = render(args.run_dir, args.out)
    except ValueError as error:
        parser.error(str(error))
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
