"""Asynchronous GRPO: steps per hour at rollout.max_staleness = 0, 1, 2 under long-tailed rollouts, with
the trainer's and the generator's idle fractions.

The GRPO stage runs as it does in training (``osvl.trainer.run_grpo``, the local form: the
rollout generator on its event-loop thread with its own engine copy, the trainer's forward,
fused loss, backward and AdamW on the tiny Qwen3-VL in the main thread). Generation is a
timed stand-in for a GPU server: a scripted policy (forced decoding: the ids are scripted, the
logprobs are the engine model's own) whose every turn takes ``--turn-s`` seconds of wall time,
and ``--long-frac`` of the trajectories take ``--long-factor`` times longer per turn, the long
tail of agentic rollouts; each trajectory calls a tool, then answers. The sleep costs no CPU, so
the 2 cores go to training, as they would with the servers on other GPUs. Every setting runs the
same prompts and seeds in one process; the result is each setting's steps per hour and its ratio
to the synchronous N = 0 run, over the steps after the first (which waits for the first rollouts
in every setting).

Idle fractions per step: the trainer's is the share of the step it waited for groups; the
generator's is the share of the step no group was rolling out (at N = 0 it idles while the trainer
trains; at N >= 1 the next steps' groups roll out meanwhile). A step takes the groups that finished
first, so long trajectories are the ones that go stale: ``long_share_trained`` (against the
workload's ``--long-frac``) shows how much of the long tail a setting trained on, and
``stale_groups`` how much generation it threw away (or rolled out again: ``--stale-groups``).

    python -m bench.rollout.bench_async [--staleness 0 1 2] [--steps 8] [--turn-s 0.4] [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.kernels.report import git_info
from osvl.config import load_recipe
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.rl.trajectory import Prompt, ToolResult, ToolStatus, write_prompts
from osvl.rollout import GenerationRequest, GenerationResult, LocalEngine, ReplayEngine, RolloutRecorder
from osvl.tools import ToolEnvironment, ToolRegistry
from osvl.tools.registry import ToolSpec
from osvl.trainer import read_metrics, run_grpo

SCHEMA = "osvl.bench.async_grpo/1"
REPO = Path(__file__).resolve().parents[2]
WORDS = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor"]
LONG_MARK = "slowly"


def _call(word: str, long: bool = False) -> str:
    query = f"{word} {LONG_MARK}" if long else word  # a long trajectory says so, for counting what was trained on
    return f'<think>look it up</think>\n<tool_call>{{"name": "lookup", "arguments": {{"q": "{query}"}}}}</tool_call>'


def _answer(word: str) -> str:
    return f"<think>found it</think>\n<response>{word}</response>"


class InstantTools:
    """The lookup tool answers at once: the workload's time is generation and training."""

    def call(self, job) -> ToolResult:
        return ToolResult(status=ToolStatus.OK, tool=job.tool, text=f"found: {job.arguments.get('q', '')}")

    async def acall(self, job) -> ToolResult:
        return self.call(job)


@contextmanager
def instant_environment(recipe, rank):
    spec = ToolSpec(
        name="lookup",
        description="look a word up",
        parameters={"type": "object", "properties": {"q": {"type": "string"}}},
        target="bench.rollout.bench_async:InstantTools",
    )
    yield ToolEnvironment(ToolRegistry([spec]), InstantTools())


class PacedPolicy:
    """Forced decoding of the scripted turns (call, then answer) after a wall-clock turn latency."""

    def __init__(self, local: LocalEngine, turn_s: float, long_factor: float, long_frac: float) -> None:
        self.local, self.turn_s, self.long_factor, self.long_frac = local, turn_s, long_factor, long_frac
        self.replay = ReplayEngine(local, self._script)

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    def _turn(self, request: GenerationRequest) -> tuple[int, str]:
        text = self.local.tokenizer.decode(request.input_ids)
        word = next((w for w in WORDS if f"code word is {w}" in text), WORDS[0])
        return text.count("</tool_call>"), word

    def _script(self, request: GenerationRequest) -> list[int]:
        turn, word = self._turn(request)
        tok = self.local.tokenizer
        return tok.encode(_call(word, self.is_long(request)) if turn == 0 else _answer(word)) + [tok.special.im_end]

    def is_long(self, request: GenerationRequest) -> bool:
        turn, _ = self._turn(request)
        trajectory_seed = (request.sampling.seed or 0) - turn  # the same for every turn of a trajectory
        return (trajectory_seed % 1000) < self.long_frac * 1000

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await asyncio.sleep(self.turn_s * (self.long_factor if self.is_long(request) else 1.0))
        return await self.replay.generate(request)


def write_inputs(root: Path, prompts: int) -> tuple[Path, Path]:
    corpus = [_call(w, long=True) + _answer(w) + f" The code word is {w}. What is it? found: {w}" for w in WORDS] * 8
    tok = train_bpe_tokenizer(corpus, vocab_size=384)
    tok.save(root / "tokenizer.json")
    write_prompts(
        root / "prompts.jsonl",
        [
            Prompt(id=f"p{i}", question=f"The code word is {WORDS[i % 8]}. What is it?", answer=WORDS[i % 8])
            for i in range(prompts)
        ],
    )
    return root / "tokenizer.json", root / "prompts.jsonl"


def run_setting(args: argparse.Namespace, staleness: int, root: Path, tokenizer: Path, prompts: Path) -> dict:
    run_dir = root / f"n{staleness}"
    overrides = [
        f"data.tokenizer={tokenizer}",
        f"data.train_path={prompts}",
        f"job.run_dir={run_dir}",
        "model.pretrained=",
        f"grpo.max_steps={args.steps}",
        f"grpo.batch_prompts={args.batch_prompts}",
        f"grpo.mini_batch_prompts={args.batch_prompts // 2}",
        f"grpo.group_size={args.group_size}",
        "grpo.max_response_tokens=64",
        "grpo.max_prompt_tokens=512",
        "rollout.max_turns=4",
        f"rollout.max_in_flight={args.max_in_flight}",
        "rollout.trajectory_deadline_s=3600",
        "rollout.max_retries=0",
        f"rollout.max_staleness={staleness}",
        "tools.fault_rate=0.0",
        f"rollout.stale_groups={args.stale_groups}",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "metrics.console=false",
        "metrics.tensorboard=false",
    ]
    start = time.perf_counter()
    run_grpo(
        load_recipe("tiny_grpo", overrides),
        environment=instant_environment,
        engine_wrapper=lambda local: PacedPolicy(local, args.turn_s, args.long_factor, args.long_frac),
    )
    wall = time.perf_counter() - start
    steady = read_metrics(run_dir)[1:]  # the first step waits for the first rollouts in every setting

    def mean(key: str) -> float:
        return sum(m[key] for m in steady) / len(steady)

    seconds = sum(m["step_time_s"] for m in steady)
    recorder = RolloutRecorder(run_dir / "rollouts")
    trained = [t for m in steady for t in recorder.read(m["step"]) if t.steps and t.steps[0].tool_call]
    long_share = sum(t.steps[0].tool_call.arguments.get("q", "").endswith(LONG_MARK) for t in trained) / len(trained)
    return {
        "max_staleness": staleness,
        "steps": args.steps,
        "steady_steps": len(steady),
        "wall_s": wall,
        "steady_s": seconds,
        "steps_per_hour": 3600 * len(steady) / seconds,
        "trainer_idle_frac": mean("trainer_idle_frac"),
        "generator_idle_frac": mean("generator_idle_frac"),
        "time_train_s": mean("time_train_s"),
        "time_wait_s": mean("time_wait_s"),
        "group_lag_mean": mean("group_lag_mean"),
        "offpolicy_token_frac": mean("offpolicy_token_frac"),
        "stale_groups": sum(m["stale_groups"] for m in read_metrics(run_dir)),
        "regenerated": sum(m["regenerated"] for m in read_metrics(run_dir)),
        "long_share_trained": long_share,
        "reward": mean("reward"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.rollout.bench_async", description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-in-flight", type=int, default=32)
    parser.add_argument("--turn-s", type=float, default=0.4, help="wall time of one generated turn")
    parser.add_argument("--long-factor", type=float, default=10.0, help="how much longer a long trajectory's turn is")
    parser.add_argument("--long-frac", type=float, default=0.1, help="share of trajectories that are long")
    parser.add_argument("--stale-groups", choices=("drop", "regenerate"), default="drop")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    parser.add_argument(
        "--out", default="", help="JSON path; default bench/rollout/results/async_grpo-cpu-<commit>.json"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if 0 not in args.staleness:
        raise SystemExit("--staleness must include 0: it is the baseline the ratios are taken against")
    if args.threads:
        torch.set_num_threads(args.threads)
    git = git_info(REPO)
    record = {
        "schema": SCHEMA,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git,
        "argv": vars(args),
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_avg": os.getloadavg(),
        },
        "workload": {
            "trajectories_per_step": args.batch_prompts * args.group_size,
            "short_trajectory_s": 2 * args.turn_s,
            "long_trajectory_s": 2 * args.turn_s * args.long_factor,
            "long_frac": args.long_frac,
        },
        "settings": [],
    }
    with tempfile.TemporaryDirectory(prefix="osvl-bench-async-") as tmp:
        root = Path(tmp)
        tokenizer, prompts = write_inputs(root, prompts=max(2 * args.batch_prompts, 8))
        for staleness in args.staleness:
            result = run_setting(args, staleness, root, tokenizer, prompts)
            record["settings"].append(result)
            print(json.dumps(result), flush=True)
    base = next(s for s in record["settings"] if s["max_staleness"] == 0)
    for s in record["settings"]:
        s["speedup_vs_sync"] = s["steps_per_hour"] / base["steps_per_hour"]
    record["host"]["load_avg_end"] = os.getloadavg()
    out = Path(args.out or REPO / "bench" / "rollout" / "results" / f"async_grpo-cpu-{git['short']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}", flush=True)
    return record


if __name__ == "__main__":
    main()
