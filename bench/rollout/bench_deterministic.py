"""Cost of ``rollout.deterministic``: GRPO step time with and without it on the tiny recipe.

``tiny_grpo`` as the demo runs it (``rollout.max_in_flight`` 8, G = 4, 4 prompts a step, up to 256
tokens a turn) against the embedded mini-world's tools, on one process. Without ``--pretrained``
(an SFT export such as ``runs/tiny_sft/hf`` after ``make demo``, with its ``--tokenizer`` and
``--prompts``) the policy has random weights and a tokenizer and prompts written here: its turns
are malformed and run to the token budget, so the step is decode-bound, the case where batching
matters most. Runs alternate batched / deterministic ``--repeats`` times, each ``--steps`` GRPO
steps; step times after each run's first step are pooled, and the result is the ratio of medians.
It also counts step 1's rollouts (ids, logprobs) that differ between two runs of the same mode:
the nondeterminism the mode removes.

    python -m bench.rollout.bench_deterministic [--steps 3] [--repeats 2] [--out bench/rollout/results/...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from bench.kernels.report import git_info
from osvl.config import load_recipe
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.rl.trajectory import Prompt, write_prompts
from osvl.rollout import RolloutRecorder
from osvl.trainer import read_metrics, run_grpo
from osvl.world.__main__ import main as world_main

SCHEMA = "osvl.bench.deterministic/1"
REPO = Path(__file__).resolve().parents[2]
MODES = {"batched": "false", "deterministic": "true"}
CITIES = ["Inverness", "Oslo", "Lyon", "Porto", "Graz", "Turku", "Gent", "Bergen"]
CORPUS = [
    '<think>search the bridge</think>\n<tool_call>\n{"name": "text_search", "arguments": '
    '{"query": "bridge opened"}}\n</tool_call>',
    "<think>found it</think>\n<response>1982</response>",
    *[f"When did the bridge in {city} open? It opened in {1900 + 7 * i}." for i, city in enumerate(CITIES)],
] * 8


def write_data(root: Path) -> tuple[Path, Path, Path]:
    """Tokenizer, RL prompts and the mini-world for a random-init policy."""
    tokenizer = train_bpe_tokenizer(CORPUS, vocab_size=400)
    tokenizer.save(root / "tokenizer.json")
    write_prompts(
        root / "prompts.jsonl",
        [
            Prompt(id=f"q{i}", question=f"When did the bridge in {city} open?", answer=str(1900 + 7 * i))
            for i, city in enumerate(CITIES)
        ],
    )
    if world_main(["build", "--out", str(root / "world"), "--seed", "0"]) != 0:
        raise RuntimeError("building the mini-world failed")
    return root / "tokenizer.json", root / "prompts.jsonl", root / "world"


def one_run(overrides: list[str], run_dir: Path) -> tuple[list[dict], list[tuple]]:
    """Per-step metrics and step 1's rollouts of one GRPO run."""
    run_grpo(load_recipe("tiny_grpo", [*overrides, f"job.run_dir={run_dir}"]))
    rollouts = [
        (t.group_id, t.sample_index, tuple((tuple(s.token_ids), tuple(s.logprobs)) for s in t.steps))
        for t in RolloutRecorder(run_dir / "rollouts").read(1)
    ]
    return read_metrics(run_dir), rollouts


def summarize(runs: list[list[dict]]) -> dict:
    later = [m for run in runs for m in run[1:]]  # each run's first step warms up
    return {key: statistics.median(m[key] for m in later) for key in ("step_time_s", "time_rollout_s")} | {
        "step_time_s_all": [round(m["step_time_s"], 3) for m in later]
    }


def differing(first: list[tuple], second: list[tuple]) -> int:
    return sum(a != b for a, b in zip(first, second, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description="GRPO step time with and without rollout.deterministic")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pretrained", default="", help="an SFT export (default: random weights)")
    parser.add_argument("--tokenizer", default="", help="with --pretrained: the tokenizer it was trained with")
    parser.add_argument("--prompts", default="", help="RL prompts JSONL (default: written here)")
    parser.add_argument("--world", default="", help="the mini-world directory (default: built here)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="further tiny_grpo overrides, e.g. --set grpo.max_response_tokens=64",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 (the first step is a warm-up) and --repeats >= 1")
    if bool(args.pretrained) != bool(args.tokenizer):
        parser.error("--pretrained and --tokenizer go together")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="osvl-bench-deterministic-") as tmp:
        root = Path(tmp)
        tokenizer, prompts, world = (
            write_data(root)
            if not (args.tokenizer and args.prompts and args.world)
            else (Path(args.tokenizer), Path(args.prompts), Path(args.world))
        )
        base = [
            f"data.tokenizer={args.tokenizer or tokenizer}",
            f"data.train_path={args.prompts or prompts}",
            f"tools.world_dir={args.world or world}",
            f"model.pretrained={args.pretrained}",
            f"grpo.max_steps={args.steps}",
            "checkpoint.every_steps=0",
            "checkpoint.export_hf=false",
            "metrics.console=false",
            "metrics.tensorboard=false",
            *args.overrides,
        ]
        metrics: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
        rollouts: dict[str, list[list[tuple]]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):  # interleaved, so load drifts hit both modes alike
            for mode, flag in MODES.items():
                m, r = one_run([*base, f"rollout.deterministic={flag}"], root / f"{mode}{repeat}")
                metrics[mode].append(m)
                rollouts[mode].append(r)
    runs = {mode: summarize(metrics[mode]) for mode in MODES}
    for mode in MODES:
        if args.repeats > 1:
            runs[mode]["differing_step1_rollouts"] = differing(*rollouts[mode][:2])
        runs[mode]["step1_rollouts"] = len(rollouts[mode][0])
    git = git_info(REPO)
    result = {
        "schema": SCHEMA,
        "git": git,
        "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},  # others' work on the machine
        "workload": {
            "recipe": "tiny_grpo",
            "steps": args.steps,
            "repeats": args.repeats,
            "pretrained": args.pretrained or "random init",
            "overrides": args.overrides,
        },
        "runs": runs,
        "deterministic_vs_batched": {
            key: runs["deterministic"][key] / runs["batched"][key] for key in ("step_time_s", "time_rollout_s")
        },
    }
    out = args.out or REPO / f"bench/rollout/results/deterministic-cpu-{git['short']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"runs": runs, "deterministic_vs_batched": result["deterministic_vs_batched"]}, indent=2))


if __name__ == "__main__":
    main()
