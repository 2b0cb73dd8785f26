"""One run of the fault matrix: GRPO on 2 spawned gloo trainer ranks over the CPU service topology (the
scripted SGLang loopback server, one tool server, the loopback judge, all supervised as ``osvl.serve
--launch`` supervises them), one process killed with SIGKILL at a chosen moment of a chosen step, and
what came of it: the steps taken, whether the run finished or stopped with its one line, in how many
seconds, the records and checkpoints it left, the processes it left behind.

``python -m tests.trainer.faults OUT [SEED]`` runs every cell (fault x step x mode, a seeded random moment
of the step) and writes ``OUT/matrix.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("tools", "engine", "judge", "rank")
MODES = {"sync": 0, "staleness1": 1}
STEPS = 6  # the kill lands in step 1, 2 or 3 (KILL_STEPS): later steps show whether a restarted service is used again
KILL_STEPS = (1, 2, 3)  # step 0: the start-up (pre-flight, first weight sync), which main() adds for the docs
MAX_DELAY_S = 0.5  # into the step; a step takes 1-3 s here (the kill lands inside it)
STEP_DEADLINE_S = 45.0  # rollout.step_deadline_s of every run: the longest a rank waits for its groups
COLLECTIVE_TIMEOUT_S = 90.0
HANG_S = 240.0  # past this the harness calls it a hang and kills what is left


@dataclass
class Outcome:
    fault: str
    step: int  # the step during which the victim was killed
    delay_s: float  # seconds into that step
    mode: str
    result: str  # "finished" (every step taken), "stopped" (non-zero, with a message) or "hang"
    seconds: float  # from the trainer's start to its end (or to the hang verdict)
    steps_logged: list[int] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    message: str = ""  # the stop line, or the first error line of a rank
    killed_pid: int = 0
    records_clean: bool = True
    leftovers: list[int] = field(default_factory=list)  # processes of the run still alive after it
    healed: bool | None = None  # after a service restart: a later step used the service again


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out |= {child} | _descendants(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rank_main(rank: int, world: int, port: int, overrides: list[str], tool_url: str, out: str) -> None:
    """A trainer rank as ``osvl.train`` runs one: its process group under the recipe's collective timeout,
    the GRPO stage, the stop line on ``RunStopped``; exit 0, 1 (stopped) or 2 (an error)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from osvl.config import load_recipe
    from osvl.parallel import teardown, use_host_device
    from osvl.trainer import run_grpo
    from osvl.trainer.watchdog import RunStopped, collective_timeout_s
    from tests.trainer.test_grpo_services import fleet_environment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sys.stdout = open(Path(out, f"rank{rank}.out"), "w", buffering=1)  # noqa: SIM115 - the rank's whole life
    torch.set_num_threads(1)
    recipe = load_recipe("tiny_grpo_services", overrides)
    use_host_device()
    timeout = timedelta(seconds=collective_timeout_s(recipe, recipe.data_parallel_size(world)))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    code, line = 0, ""
    try:
        run_grpo(recipe, rank, world, environment=functools.partial(fleet_environment, urls=(tool_url,)))
    except RunStopped as stopped:
        code, line = 1, str(stopped)
    except BaseException as error:  # noqa: BLE001 - recorded for the matrix, then the rank dies
        code, line = 2, "".join(traceback.format_exception_only(error)).strip()
        Path(out, f"rank{rank}.traceback").write_text(traceback.format_exc())
    Path(out, f"rank{rank}.exit").write_text(json.dumps({"code": code, "line": line}))
    if code == 0:
        teardown()
    os._exit(code)


@contextlib.contextmanager
def services(root: Path, model_dir: Path):
    """The supervised services; yields ``(supervisor, urls)``."""
    from osvl.serve.supervisor import RestartPolicy, ServiceSpec, Supervisor

    python = (sys.executable, "-m")
    specs = [
        ServiceSpec("engine", (*python, "tests.trainer.services", "sglang", str(model_dir))),
        ServiceSpec("tools", (*python, "tests.trainer.services", "tools")),
        ServiceSpec("judge", (*python, "osvl.serve.loopback_judge")),
    ]
    log: list[str] = []
    supervisor = Supervisor(specs, root, RestartPolicy(first_delay_s=0.5), log=log.append)
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{ROOT}:{ROOT / 'kernels'}"
    stop = threading.Event()
    supervising = threading.Thread(target=supervisor.run, args=(stop, 0.1), daemon=True)
    try:
        urls = supervisor.start()
        supervising.start()
        yield supervisor, urls
    finally:
        stop.set()
        supervising.join(60)
        supervisor.stop()
        if previous is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = previous


def _records(run_dir: Path) -> tuple[list[int], bool]:
    """The steps metrics.jsonl logged, and whether the records are whole (every line parses, the steps
    consecutive, each step's rollouts readable) and every complete checkpoint is of a logged step (a save
    a kill cut short has no completion marker: the relaunch discards it)."""
    from osvl.rollout import RolloutRecorder
    from osvl.trainer.checkpoint import MARKER

    metrics = run_dir / "metrics.jsonl"
    steps: list[int] = []
    clean = True
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                clean = False
    clean &= steps == list(range(1, len(steps) + 1))
    recorder = RolloutRecorder(run_dir / "rollouts")
    for step in steps:
        try:
            clean &= len(list(recorder.read(step))) > 0
        except (OSError, ValueError):
            clean = False
    complete = [
        int(c.name.removeprefix("step_")) for c in (run_dir / "checkpoints").glob("step_*") if (c / MARKER).is_file()
    ]
    clean &= all(step <= (steps[-1] if steps else 0) for step in complete)  # a save cut short has no marker: discarded
    return steps, clean


def _healed(run_dir: Path, fault: str, step: int) -> bool | None:
    """Whether a step after the one the service died in used it again: no rollout hit an infrastructure
    error (the tool server, the engine) or went unscored (the judge). None for a trainer rank."""
    from osvl.trainer import read_metrics

    if fault == "rank" or not (run_dir / "metrics.jsonl").is_file():
        return None
    later = [m for m in read_metrics(run_dir) if m["step"] > step]
    key = "unscored" if fault == "judge" else "infra_hit"
    return any(m[key] == 0 for m in later) if later else None


def run_fault(
    root: Path, base: list[str], model_dir: Path, fault: str, step: int, delay_s: float, mode: str
) -> Outcome:
    """One run: ``fault`` killed ``delay_s`` seconds into step ``step`` (after step - 1 was logged; step 1
    begins after the pre-flight, step 0 is the start-up)."""
    run_dir = root / "run"
    out = root / "ranks"
    out.mkdir(parents=True)
    outcome = Outcome(fault, step, delay_s, mode, "hang", 0.0)
    with services(root, model_dir) as (supervisor, urls):
        engine_url, tool_url, judge_url = urls
        overrides = base + [
            f"job.run_dir={run_dir}",
            f'rollout.sglang_urls=["{engine_url}"]',
            f"judges.url={judge_url}",
            f"rollout.max_staleness={MODES[mode]}",
        ]
        context = multiprocessing.get_context("spawn")
        port = _free_port()
        ranks = [
            context.Process(target=rank_main, args=(r, 2, port, overrides, tool_url, str(out)), daemon=False)
            for r in range(2)
        ]
        started = time.monotonic()
        for process in ranks:
            process.start()
        seen: set[int] = {p.pid for p in ranks}
        killed = False
        step_began: float | None = None
        while time.monotonic() - started < HANG_S and any(p.is_alive() for p in ranks):
            for p in ranks:
                seen |= _descendants(p.pid)
            logged = (
                len((run_dir / "metrics.jsonl").read_text().splitlines())
                if (run_dir / "metrics.jsonl").is_file()
                else 0
            )
            if step == 0:  # the start-up: the stage has begun (its metrics header), before the pre-flight
                began = (run_dir / "recipe.json").is_file()
            elif step == 1:  # after the pre-flight, as the first rollouts start
                printed = (out / "rank0.out").read_text() if (out / "rank0.out").is_file() else ""
                began = "pre-flight:" in printed and "probe of" in printed  # the engine probe comes last
            else:
                began = logged >= step - 1
            if began and step_began is None:
                step_began = time.monotonic()
            if not killed and step_began is not None and time.monotonic() - step_began >= delay_s:
                if fault == "rank":
                    victim = ranks[1].pid
                else:
                    victim = next(s for s in supervisor.services if s.spec.name == fault).process.pid
                os.kill(victim, signal.SIGKILL)
                outcome.killed_pid, killed = victim, True
            time.sleep(0.05)
        outcome.seconds = time.monotonic() - started
        hung = any(p.is_alive() for p in ranks)
        if hung:
            for p in ranks:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
        elif any(p.exitcode for p in ranks) and all(p.exitcode is not None for p in ranks):
            for p in ranks:  # a rank that died takes the others down, as torchrun's agent does
                p.join(1)
        for p in ranks:
            p.join(5)
        outcome.exit_codes = [p.exitcode for p in ranks]
    exits = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.exit"))]
    lines = [e["line"] for e in exits if e["line"]]
    outcome.message = lines[0] if lines else ""
    outcome.steps_logged, outcome.records_clean = _records(run_dir)
    if not hung:
        outcome.result = (
            "finished"
            if outcome.steps_logged == list(range(1, STEPS + 1)) and not any(outcome.exit_codes)
            else "stopped"
        )
    time.sleep(0.5)
    outcome.leftovers = sorted(pid for pid in seen if _alive(pid))
    outcome.healed = _healed(run_dir, fault, step)
    return outcome


def matrix_overrides(root: Path) -> tuple[list[str], Path]:
    """The matrix's recipe overrides (deadlines short enough for a test) and the served checkpoint."""
    from tests.trainer.test_grpo import grpo_overrides
    from tests.trainer.test_grpo_services import _served_checkpoint

    base = grpo_overrides(
        root,
        root / "run",
        f"grpo.max_steps={STEPS}",
        "model.preset=tiny",
        "rollout.engine=sglang",
        'rollout.sglang_urls=["http://127.0.0.1:1"]',
        "rollout.max_logprob_diff=1e-4",
        "rollout.server_reconnect_s=30",
        "rollout.request_timeout_s=30",
        "rollout.trajectory_deadline_s=30",
        f"rollout.step_deadline_s={STEP_DEADLINE_S}",
        f"job.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
        "tools.fault_rate=0.0",
        "judges.accuracy=llm",
        "judges.query=llm",
        "judges.url=http://127.0.0.1:1/v1",
        "judges.model=loopback-judge",
        "judges.max_attempts=2",
        "judges.overload_wait_s=1",
        "judges.timeout_s=5",
        "checkpoint.every_steps=1",
    )
    return base, _served_checkpoint(root, base)


def main(argv: list[str] | None = None) -> int:
    import random

    parser = argparse.ArgumentParser(
        prog="python -m tests.trainer.faults", description="every cell of the fault matrix, one JSON line each"
    )
    parser.add_argument("out", type=Path, help="a directory for the runs and matrix.json")
    parser.add_argument("seed", type=int, nargs="?", default=0, help="draws each kill's moment in its step")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    base, model_dir = matrix_overrides(out / "shared")
    rng = random.Random(args.seed)
    results = []
    for mode in MODES:
        for fault in FAULTS:
            for step in (0, *KILL_STEPS):
                delay = round(rng.uniform(0.0, MAX_DELAY_S), 2)
                outcome = run_fault(out / f"{mode}_{fault}_{step}", base, model_dir, fault, step, delay, mode)
                print(json.dumps(asdict(outcome)), flush=True)
                results.append(asdict(outcome))
    (out / "matrix.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
