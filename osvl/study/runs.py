"""The runs of the fatal-mode ablation (paper Table 3b), one resumable study: ``make ablation``.

From the demo's SFT checkpoint, GRPO (``tiny_grpo``) runs in each fatal mode x seed x outage rate
with outages counted toward the fatal rule and outage-hit rollouts kept (the paper's handling), and
at the outage rate also under the other error-counting choices (``grpo.fatal_errors`` /
``grpo.infra_rollouts``). Every run is then evaluated greedily on the demo's held-out prompts,
without faults or outages, one row per prompt; the SFT checkpoint is evaluated the same way.
:mod:`osvl.study.report` turns the rows into the tables, intervals and plots of ``docs/ablation.md``;
``python -m osvl.study`` plans, runs and reports the study.

Runs go to ``--out`` (default ``runs/ablation``; ``--quick``: ``runs/ablation_quick``), one
directory each. A run is resumable: it checkpoints every ``checkpoint_every`` steps and resumes from
the newest checkpoint, skips training once its HF export exists and is done once ``done.json`` exists,
so ``run`` again continues where an interrupted study stopped. Each run is one process on
``--threads`` CPU threads (one tool worker); ``--jobs`` of them run at once. Injected independent
faults are off (``tools.fault_rate = 0``): the fatal rollouts come from outages and the policy.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from osvl.lifetime import die_with_parent
from osvl.rl.advantages import MODES
from osvl.rl.trajectory import Trajectory

SFT_RUN = "sft"
DONE = "done.json"
ROWS = "eval.jsonl"
# tiny_grpo's 600 s bounds a whole trajectory on an idle machine, where one takes seconds; 32 rollouts sharing
# one engine on a machine loaded 7x over ran past it and were dropped as infra errors (every SFT evaluation
# rollout of a pilot). The study waits instead, so what it measures does not depend on the machine's load.
TRAJECTORY_DEADLINE_S = 7200.0


@dataclass(frozen=True)
class RunSpec:
    """One GRPO run of the study."""

    mode: str
    seed: int
    outage_rate: float
    errors: str = "all"  # grpo.fatal_errors
    infra_rollouts: str = "keep"  # grpo.infra_rollouts

    @property
    def choice(self) -> str:
        return f"{self.errors}/{self.infra_rollouts}"

    @property
    def name(self) -> str:
        return f"outage{self.outage_rate:g}-{self.errors}-{self.infra_rollouts}/{self.mode}/seed{self.seed}"


@dataclass(frozen=True)
class StudyConfig:
    """What the study runs. The defaults are the full study; :data:`QUICK` is its smoke form."""

    out: str = "runs/ablation"
    sft: str = "runs/tiny_sft/hf"
    world: str = "runs/demo/world"
    tokenizer: str = "runs/demo/data/tokenizer.json"
    prompts: str = "runs/demo/data/rl_short/prompts.jsonl"
    eval_prompts: str = "runs/demo/data/rl_short/eval.jsonl"
    recipe: str = "tiny_grpo"
    # GRPO as `make demo` runs it, the policy that learns (docs/demo.md): its model size, groups of 8 (the
    # paper's), 8 prompts a step in 2 PPO mini-batches, lr 3e-4. Steps: the pilot's choice, on vanilla at
    # outage 0 alone (docs/ablation.md): the demo's 16, where its held-out gain over SFT cleared zero.
    preset: str = "small"
    group_size: int = 8
    batch_prompts: int = 8
    mini_batch_prompts: int = 4
    steps: int = 16
    lr: float = 3e-4
    seeds: tuple[int, ...] = (0, 1, 2)
    modes: tuple[str, ...] = MODES
    rates: tuple[float, ...] = (0.0, 0.3)
    choice_rate: float = 0.3  # where the other error-counting choices run
    choices: tuple[tuple[str, str], ...] = ()  # OTHER_CHOICES with `--choices`
    choice_modes: tuple[str, ...] = ("vanilla", "fatal_clamp")
    eval_limit: int = 0  # held-out prompts evaluated (0 = all)
    checkpoint_every: int = 4
    overrides: tuple[str, ...] = ()  # extra KEY=VALUE for every run (tests: tiny sizes)

    def __post_init__(self) -> None:
        if self.steps < 1 or not self.seeds or not self.rates or not self.lr > 0 or self.group_size < 2:
            raise ValueError(
                f"the study needs steps >= 1, seeds, rates, lr > 0 and groups of >= 2, got {self.steps}, "
                f"{self.seeds}, {self.rates}, {self.lr}, {self.group_size}"
            )
        unknown = [m for m in (*self.modes, *self.choice_modes) if m not in MODES]
        if unknown:
            raise ValueError(f"unknown fatal modes {unknown}; expected some of {MODES}")
        for errors, infra in self.choices:
            if (errors, infra) not in (("policy", "drop"), ("policy", "keep"), ("all", "keep")):
                raise ValueError(
                    f"unknown error-counting choice {errors}/{infra}: expected policy/drop, policy/keep or all/keep"
                )


# the error-counting choices besides the paper's all/keep that the study can add at its choice rate
OTHER_CHOICES = (("policy", "drop"), ("policy", "keep"))
QUICK = StudyConfig(
    out="runs/ablation_quick",
    steps=2,
    seeds=(0, 1),
    eval_limit=8,
    choices=OTHER_CHOICES,
    choice_modes=("fatal_clamp",),
)


def plan(study: StudyConfig) -> list[RunSpec]:
    """Every run, seed-major, so a study stopped half way has every setting at the first seeds."""
    runs = []
    for seed in study.seeds:
        for rate in study.rates:
            runs += [RunSpec(mode, seed, rate) for mode in study.modes]
        for errors, infra in study.choices:
            runs += [RunSpec(mode, seed, study.choice_rate, errors, infra) for mode in study.choice_modes]
    return runs


def run_dir(study: StudyConfig, spec: RunSpec | str) -> Path:
    return Path(study.out) / (spec if isinstance(spec, str) else spec.name)


def check_inputs(study: StudyConfig) -> None:
    """The demo's artifacts the study starts from, named with the command that makes them."""
    needed = {
        "--sft": Path(study.sft) / "config.json",
        "--world": Path(study.world) / "corpus.jsonl",
        "--tokenizer": Path(study.tokenizer),
        "--prompts": Path(study.prompts),
        "--eval-prompts": Path(study.eval_prompts),
    }
    missing = [f"{flag} {path}" for flag, path in needed.items() if not path.is_file()]
    if missing:
        raise ValueError(f"missing inputs: {', '.join(missing)}; `make demo` makes them (or pass the flags)")


def grpo_overrides(study: StudyConfig, spec: RunSpec) -> list[str]:
    return [
        f"model.preset={study.preset}",
        f"grpo.group_size={study.group_size}",
        f"grpo.batch_prompts={study.batch_prompts}",
        f"grpo.mini_batch_prompts={study.mini_batch_prompts}",
        f"model.pretrained={study.sft}",
        f"data.tokenizer={study.tokenizer}",
        f"data.train_path={study.prompts}",
        f"tools.world_dir={study.world}",
        f"job.run_dir={run_dir(study, spec)}",
        f"job.seed={spec.seed}",
        f"grpo.fatal_mode={spec.mode}",
        f"grpo.fatal_errors={spec.errors}",
        f"grpo.infra_rollouts={spec.infra_rollouts}",
        f"grpo.max_steps={study.steps}",
        f"optimizer.lr={study.lr}",
        f"tools.outage_rate={spec.outage_rate}",
        "tools.fault_rate=0",
        "tools.workers=1",
        f"checkpoint.every_steps={study.checkpoint_every}",
        "checkpoint.keep_last=1",
        "metrics.tensorboard=false",
        "metrics.console=false",
        f"rollout.max_in_flight={study.group_size * study.batch_prompts}",
        f"rollout.trajectory_deadline_s={TRAJECTORY_DEADLINE_S}",
        *study.overrides,
    ]


def eval_overrides(study: StudyConfig) -> list[str]:
    return [
        f"model.preset={study.preset}",
        f"data.tokenizer={study.tokenizer}",
        f"data.train_path={study.eval_prompts}",
        f"tools.world_dir={study.world}",
        "tools.workers=1",
        "rollout.max_in_flight=64",
        f"rollout.trajectory_deadline_s={TRAJECTORY_DEADLINE_S}",
        *study.overrides,
    ]


def prompt_row(trajectory: Trajectory) -> dict[str, Any]:
    """What the report needs of one greedy evaluation rollout. ``lookups``: a chain question's ``[issued,
    asked]`` relation lookups (:func:`osvl.rl.chain.chain_progress`), None for other questions."""
    from osvl.rl.chain import chain_progress
    from osvl.trainer.validation import answer_is_grounded

    calls = sum(step.tool_result is not None for step in trajectory.steps)
    answered = trajectory.final_answer is not None
    reward = trajectory.reward
    statuses = Counter(step.tool_result.status.value for step in trajectory.steps if step.tool_result is not None)
    generated = json.dumps([step.token_ids for step in trajectory.steps]).encode()
    lookups = chain_progress(trajectory.prompt.question, trajectory.steps)
    return {
        "prompt": trajectory.prompt.id,
        "anchor": trajectory.prompt.anchor,
        "hops": trajectory.prompt.hops,
        "correct": reward.acc if reward is not None and reward.scored else None,
        "answer": trajectory.final_answer,
        "rollout": hashlib.blake2b(generated, digest_size=8).hexdigest(),
        "answered": answered,
        "tool_calls": calls,
        "no_tool_answer": answered and calls == 0,
        "grounded": answer_is_grounded(trajectory),
        "fatal": trajectory.fatal_step >= 0,
        "turns": len(trajectory.steps),
        "finish": trajectory.finish_reason.value,
        "statuses": dict(statuses),
        "lookups": None if lookups is None else list(lookups),
    }


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _write_json(path: Path, value: Any) -> None:
    """Atomic: a reader (or a resumed study) never sees half a file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value, indent=2) + "\n")
    partial.replace(path)


def run_one(study: StudyConfig, spec: RunSpec | None, threads: int = 1, engine_wrapper: Callable | None = None) -> None:
    """Train (or resume) one run, then evaluate it; ``spec=None`` evaluates the SFT checkpoint.
    Writes ``eval.jsonl`` and finally ``done.json`` (wall and CPU seconds of this process and its tool
    workers), each atomically."""
    import torch

    from osvl.config import load_recipe
    from osvl.trainer.evaluation import evaluation_rollouts
    from osvl.trainer.grpo import run_grpo

    torch.set_num_threads(threads)
    directory = run_dir(study, spec or SFT_RUN)
    directory.mkdir(parents=True, exist_ok=True)
    started, cpu = time.perf_counter(), _cpu_seconds()
    checkpoint = study.sft
    if spec is not None:
        checkpoint = str(directory / "hf")
        if not (directory / "hf" / "config.json").is_file():
            run_grpo(load_recipe(study.recipe, grpo_overrides(study, spec)), engine_wrapper=engine_wrapper)
    trained, trained_cpu = time.perf_counter(), _cpu_seconds()
    (directory / "evaluating").touch()
    rows = [
        prompt_row(t)
        for t in evaluation_rollouts(
            load_recipe(study.recipe, eval_overrides(study)), checkpoint, study.eval_limit, engine_wrapper
        )
    ]
    partial = directory / (ROWS + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    partial.replace(directory / ROWS)
    (directory / "evaluating").unlink()
    finished = time.perf_counter()
    _write_json(
        directory / DONE,
        {
            "spec": asdict(spec) if spec is not None else None,
            "steps": study.steps if spec is not None else 0,
            "prompts": len(rows),
            "train_wall_s": trained - started,
            "eval_wall_s": finished - trained,
            "train_cpu_s": trained_cpu - cpu,
            "eval_cpu_s": _cpu_seconds() - trained_cpu,
            "threads": threads,
        },
    )


def _child(study: StudyConfig, spec: RunSpec | None, threads: int, engine_wrapper: Callable | None, log: str) -> None:
    """A run's process: its output (and its tool workers') goes to the run's log. It dies with the study's
    process however that ends (a study killed with SIGTERM or SIGKILL left its runs training on as orphans,
    which then raced the resumed study's runs for the same checkpoints)."""
    die_with_parent()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    handle = open(log, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    os.dup2(handle.fileno(), 1)
    os.dup2(handle.fileno(), 2)
    sys.stdout = sys.stderr = handle
    run_one(study, spec, threads, engine_wrapper)


@dataclass
class _Running:
    spec: RunSpec | None
    process: multiprocessing.Process
    started: float


@dataclass
class StudyResult:
    done: list[str] = field(default_factory=list)  # finished in this call
    skipped: list[str] = field(default_factory=list)  # already finished before it
    failed: list[str] = field(default_factory=list)  # "name (exit code N; see its log.txt)"
    wall_s: float = 0.0


def _label(spec: RunSpec | None) -> str:
    return SFT_RUN if spec is None else spec.name


def _steps_done(study: StudyConfig, spec: RunSpec | None) -> str:
    directory = run_dir(study, spec or SFT_RUN)
    if spec is None or (directory / "evaluating").exists():
        return "eval"
    metrics = directory / "metrics.jsonl"
    steps = {json.loads(line)["step"] for line in metrics.read_text().splitlines() if line} if metrics.is_file() else ()
    return f"step {len(steps)}/{study.steps}"


def _progress(
    study: StudyConfig,
    total: int,
    finished: int,
    running: list[_Running],
    failed: int,
    started: float,
    walls: list[float],
    jobs: int,
) -> str:
    width = 24
    filled = int(width * finished / total) if total else width
    elapsed = time.perf_counter() - started
    line = f"[{'#' * filled}{'.' * (width - filled)}] {finished}/{total} runs"
    if failed:
        line += f" ({failed} failed)"
    line += f"  {elapsed / 60:.1f} min"
    if walls:
        remaining = (total - finished) * (sum(walls) / len(walls)) / jobs
        line += f", ~{remaining / 60:.0f} min left"
    shown = ", ".join(f"{_label(r.spec)} {_steps_done(study, r.spec)}" for r in running)
    return line + (f"  | {shown}" if shown else "")


def run_study(
    study: StudyConfig,
    jobs: int = 2,
    threads: int = 1,
    engine_wrapper: Callable | None = None,
    stream: TextIO = sys.stdout,
    poll_s: float = 2.0,
) -> StudyResult:
    """Every run not yet done (the SFT evaluation first), ``jobs`` processes at a time."""
    if jobs < 1 or threads < 1:
        raise ValueError(f"jobs and threads must be >= 1, got {jobs} and {threads}")
    check_inputs(study)
    Path(study.out).mkdir(parents=True, exist_ok=True)
    _write_json(Path(study.out) / "study.json", asdict(study))
    result = StudyResult()
    pending: list[RunSpec | None] = []
    for spec in [None, *plan(study)]:
        if (run_dir(study, spec or SFT_RUN) / DONE).is_file():
            result.skipped.append(_label(spec))
        else:
            pending.append(spec)
    running: list[_Running] = []
    started = time.perf_counter()
    try:
        _schedule(study, pending, running, result, jobs, threads, engine_wrapper, stream, poll_s)
    finally:  # interrupted: stop the runs in flight; each resumes from its last checkpoint next time
        for item in running:
            item.process.terminate()
            item.process.join()
    result.wall_s = time.perf_counter() - started
    return result


def _schedule(
    study: StudyConfig,
    pending: list[RunSpec | None],
    running: list[_Running],
    result: StudyResult,
    jobs: int,
    threads: int,
    engine_wrapper: Callable | None,
    stream: TextIO,
    poll_s: float,
) -> None:
    """Start runs while fewer than ``jobs`` are in flight, collect the finished ones, print the progress."""
    context = multiprocessing.get_context("spawn")
    total = len(pending) + len(result.skipped)
    started, walls = time.perf_counter(), []
    last_line, last_print, last_done = "", 0.0, 0
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            directory = run_dir(study, spec or SFT_RUN)
            directory.mkdir(parents=True, exist_ok=True)
            process = context.Process(
                target=_child,
                args=(study, spec, threads, engine_wrapper, str(directory / "log.txt")),
                name=_label(spec),
            )
            process.start()
            running.append(_Running(spec, process, time.perf_counter()))
        time.sleep(poll_s)
        for item in [r for r in running if not r.process.is_alive()]:
            running.remove(item)
            item.process.join()
            directory = run_dir(study, item.spec or SFT_RUN)
            if item.process.exitcode == 0 and (directory / DONE).is_file():
                result.done.append(_label(item.spec))
                if item.spec is not None:
                    walls.append(time.perf_counter() - item.started)
            else:
                result.failed.append(
                    f"{_label(item.spec)} (exit code {item.process.exitcode}; see {directory / 'log.txt'})"
                )
        finished = len(result.done) + len(result.skipped)
        line = _progress(study, total, finished, running, len(result.failed), started, walls, jobs)
        if line != last_line and (time.perf_counter() - last_print > 30 or not running or finished > last_done):
            print(line, file=stream, flush=True)
            last_line, last_print, last_done = line, time.perf_counter(), finished
