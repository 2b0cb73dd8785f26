"""``make demo`` helpers: the demo tokenizer, the before/after summary, and the RL ablation table.

``python -m osvl.trainer.demo tokenizer --data DIR``   byte-level BPE over the curated set
``python -m osvl.trainer.demo summary --sft DIR --grpo DIR``
``python -m osvl.trainer.demo ablation RUN_DIR ...``  one row per fatal mode (paper Table 3b)

The ablation's four variants are ``tiny_grpo`` with one switch each, after ``make demo``::

    for m in vanilla hard_mask fatal_mask fatal_clamp; do
      torchrun --standalone --nproc_per_node 2 -m osvl.train --recipe tiny_grpo \
        --set grpo.fatal_mode=$m --set job.run_dir=runs/ablation/$m --set grpo.max_steps=8
    done
    python -m osvl.trainer.demo ablation runs/ablation/*
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from osvl.trainer.metrics import read_metrics

SUMMARY_KEYS = ("reward", "accuracy", "fatal_rate", "clamped_frac")


def demo_tokenizer(data_dir: str | Path, vocab_size: int = 2048) -> Path:
    """Trains ``data_dir/tokenizer.json`` on the SFT trajectories and RL questions it will encode."""
    from osvl.data.tokenizer import train_bpe_tokenizer
    from osvl.rl.trajectory import read_jsonl
    from osvl.synth.records import read_prompts

    data = Path(data_dir)
    sft, rl = data / "sft" / "trajectories.jsonl", data / "rl" / "prompts.jsonl"
    for path in (sft, rl):
        if not path.is_file():
            raise ValueError(f"{path} is missing: run `python -m osvl.synth run --out {data}` first")
    corpus = []
    for traj in read_jsonl(sft):
        corpus.append(traj.prompt.question)
        corpus += [s.text for s in traj.steps] + [s.observation_text for s in traj.steps if s.observation_text]
    corpus += [p.question for p in read_prompts(rl)]
    out = data / "tokenizer.json"
    train_bpe_tokenizer(corpus, vocab_size=vocab_size).save(out)
    return out


def _window_mean(records: list[dict], key: str, first: bool, width: int) -> float:
    chosen = records[:width] if first else records[-width:]
    values = [r[key] for r in chosen if key in r]
    if not values:
        raise ValueError(f"metrics have no {key!r}")
    return sum(values) / len(values)


def summary_lines(sft_dir: str | Path, grpo_dir: str | Path, width: int = 1) -> list[str]:
    """Before (first ``width`` GRPO steps) vs after (last ``width``): measured on the rollouts."""
    sft, grpo = read_metrics(sft_dir), read_metrics(grpo_dir)
    lines = [f"SFT : {len(sft)} steps, loss {sft[0]['loss']:.3f} -> {sft[-1]['loss']:.3f}  ({sft_dir})"]
    lines.append(f"GRPO: {len(grpo)} steps  ({grpo_dir})")
    for key in SUMMARY_KEYS:
        before, after = _window_mean(grpo, key, True, width), _window_mean(grpo, key, False, width)
        lines.append(f"  {key:<13} before {before:.3f}  after {after:.3f}")
    acc_before, acc_after = _window_mean(grpo, "accuracy", True, width), _window_mean(grpo, "accuracy", False, width)
    verdict = "improved" if acc_after > acc_before else "did NOT improve"
    lines.append(f"  rollout accuracy {verdict} over GRPO ({acc_before:.3f} -> {acc_after:.3f})")
    lines.append(f"plots: {Path(sft_dir) / 'plots'}  {Path(grpo_dir) / 'plots'}")
    return lines


def ablation_rows(run_dirs: Sequence[str | Path], width: int = 2) -> list[dict[str, float | str]]:
    rows = []
    for run in run_dirs:
        recipe_file = Path(run) / "recipe.json"
        if not recipe_file.is_file():
            raise ValueError(f"{run} has no recipe.json: not a run directory")
        mode = json.loads(recipe_file.read_text())["grpo"]["fatal_mode"]
        records = read_metrics(run)
        row: dict[str, float | str] = {"mode": mode, "steps": len(records), "run": str(run)}
        for key in SUMMARY_KEYS:
            row[f"{key}_first"] = _window_mean(records, key, True, width)
            row[f"{key}_last"] = _window_mean(records, key, False, width)
        rows.append(row)
    return rows


def ablation_table(rows: Sequence[dict[str, float | str]]) -> str:
    """Markdown: first/last-window means of reward, accuracy, fatal rate and clamped fraction."""
    head = "| mode | steps | " + " | ".join(f"{k} first -> last" for k in SUMMARY_KEYS) + " |"
    lines = [head, "|" + "---|" * (2 + len(SUMMARY_KEYS))]
    for row in rows:
        cells = [f"{row[f'{k}_first']:.3f} -> {row[f'{k}_last']:.3f}" for k in SUMMARY_KEYS]
        lines.append(f"| {row['mode']} | {row['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.trainer.demo")
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenizer")
    tok.add_argument("--data", required=True)
    tok.add_argument("--vocab-size", type=int, default=2048)
    summ = sub.add_parser("summary")
    summ.add_argument("--sft", required=True)
    summ.add_argument("--grpo", required=True)
    summ.add_argument("--window", type=int, default=1)
    abl = sub.add_parser("ablation")
    abl.add_argument("runs", nargs="+")
    abl.add_argument("--window", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        if args.command == "tokenizer":
            print(demo_tokenizer(args.data, args.vocab_size))
        elif args.command == "summary":
            print("\n".join(summary_lines(args.sft, args.grpo, args.window)))
        else:
            print(ablation_table(ablation_rows(args.runs, args.window)))
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
