"""``torchrun -m osvl.train`` killed (SIGKILL) the ways an operator sees it die, then relaunched.

One SFT run on 2 gloo ranks goes through every kill in turn:
1. rank 1 after a checkpoint, with steps recorded past it; while that job is frozen, a second launch
   on the same run directory is refused on both its ranks, naming the owner's host and pid;
2. both ranks while a checkpoint is being written;
3. the ``torchrun`` agent alone: its ranks must die with it, not run on as orphans;
4. a relaunch that runs to the end; then 5. a launch of the finished run.
Each relaunch's first line names the checkpoint, its step and policy version, and what it discarded;
the finished run reports its recorded final loss. In the end every step is in ``metrics.jsonl`` and
in the TensorBoard events exactly once, with the values the dead attempts had recorded for it
(resume is exact), and no lock file is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from osvl.run_lock import LOCK_FILE
from osvl.train import main as train_main
from tests.test_lifetime import alive
from tests.trainer.fixtures import sft_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 40, 4
SETTINGS = [
    f"sft.max_steps={STEPS}",
    f"checkpoint.every_steps={EVERY}",
    "metrics.console=false",
    "metrics.tensorboard=true",
    "checkpoint.export_hf=false",
]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid from its reuse); None once gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _rank_of(pid: int) -> int | None:
    """The process's RANK, or None while it has none (forked by the agent, not yet exec'd as a rank)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"RANK=")), None)


def _wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Launch:
    """One ``torchrun --nproc_per_node 2 -m osvl.train`` job; stdout and stderr go to files."""

    def __init__(self, root: Path, name: str, overrides: list[str]) -> None:
        self.out, self.err = root / f"{name}.out", root / f"{name}.err"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels"), os.environ.get("PYTHONPATH", "")]),
        }
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "osvl.train",
            "--recipe",
            "tiny_sft",
            *[a for o in overrides for a in ("--set", o)],
        ]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.agent = subprocess.Popen(command, stdout=out, stderr=err, cwd=REPO, env=env, start_new_session=True)
        self.ranks: dict[int, int] = {}
        self._started: dict[int, int | None] = {}

    def wait_for_ranks(self) -> dict[int, int]:
        def started_ranks() -> dict[int, int] | None:
            pids = _children(self.agent.pid)
            ranks = {_rank_of(pid): pid for pid in pids}
            return ranks if len(pids) == 2 and set(ranks) == {0, 1} else None

        self.ranks = _wait_for(started_ranks, 120, "the agent to start 2 ranks")
        pids = list(self.ranks.values())
        self._started = {pid: _started(pid) for pid in pids}
        return self.ranks

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def wait(self, timeout_s: float = 300) -> int:
        return self.agent.wait(timeout_s)

    def kill_everything(self) -> None:
        """Whatever of this launch still runs (a failed test must not leave ranks behind); a pid that
        has since been reused by another process is left alone."""
        if self.agent.poll() is None:
            self.agent.kill()
        for pid in self.ranks.values():
            if self._started.get(pid) is not None and _started(pid) == self._started[pid]:
                os.kill(pid, signal.SIGKILL)
        self.agent.wait(30)


def _metrics(run: Path) -> dict[int, float]:
    """step -> loss of the lines that parse, in file order (a later line of a step replaces it)."""
    records = {}
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        records[record["step"]] = record["loss"]
    return records


def _checkpoints(run: Path) -> tuple[list[int], list[int]]:
    """Steps of the complete and of the incomplete checkpoint directories."""
    dirs = sorted((run / "checkpoints").glob("step_*"))
    complete = [int(p.name[5:]) for p in dirs if (p / "complete").is_file()]
    return complete, [int(p.name[5:]) for p in dirs if int(p.name[5:]) not in complete]


def _freeze(pids) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def _expected_resume_line(run: Path, dead: dict[int, float]) -> str:
    """A pattern of what the relaunch must print, from the state the dead attempt left (the count of
    TensorBoard events depends on how many of the last step's events were flushed before the kill)."""
    complete, incomplete = _checkpoints(run)
    at = complete[-1]
    discarded = []
    beyond = sorted(s for s in dead if s > at)
    if beyond:
        discarded.append(re.escape(f"metrics of steps {beyond[0]}" + (f"-{beyond[-1]}" if len(beyond) > 1 else "")))
        discarded.append(r"\d+ TensorBoard events")
    if incomplete:
        discarded.append(re.escape("checkpoints " + ", ".join(f"step_{s:08d}" for s in incomplete)))
    head = re.escape(
        f"resume: {run}/checkpoints/step_{at:08d} at step {at} of {STEPS} (policy version {at}); "
        f"discarded after step {at}: "
    )
    return head + ("; ".join(discarded) or "nothing")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    run = root / "run"
    overrides = sft_overrides(root / "data", run, *SETTINGS)
    launches: list[Launch] = []
    seen: dict = {"dead": {}}

    def launch(name):
        launches.append(Launch(root, name, overrides))
        return launches[-1]

    def remember_dead_attempt(name):
        """The dead attempt's records, its resume line to expect, and whose lock it left (a rank 0 that
        unwound, e.g. on the collective error after its peer died, released it on the way out)."""
        for step, loss in _metrics(run).items():
            seen["dead"].setdefault(step, []).append(loss)
        seen[f"expect_{name}"] = _expected_resume_line(run, _metrics(run))
        lock = run / LOCK_FILE
        seen[f"stale_{name}"] = json.loads(lock.read_text())["pid"] if lock.exists() else None

    def head(started, name):
        lines = 2 if seen[f"stale_{name}"] else 1
        _wait_for(lambda: len(started.lines()) >= lines, 240, f"the first {lines} line(s) of the {name} launch")
        seen[f"{name}_lines"] = started.lines()

    try:
        # 1. kill rank 1 after a checkpoint, with steps recorded past it
        first = launch("first")
        ranks = first.wait_for_ranks()
        while True:
            _wait_for(
                lambda: _checkpoints(run)[0] and max(_metrics(run), default=0) > _checkpoints(run)[0][-1],
                240,
                "a checkpoint with steps recorded past it",
                0.01,
            )
            _freeze(ranks.values())
            if max(_metrics(run)) > _checkpoints(run)[0][-1]:
                break
            for pid in ranks.values():  # it saved again meanwhile: let it run to the next chance
                os.kill(pid, signal.SIGCONT)
        frozen_metrics = (run / "metrics.jsonl").read_bytes()
        refused = launch("refused")  # a second job while the first one lives
        seen["refused_code"] = refused.wait()
        seen["refused_err"] = refused.err.read_text()
        seen["untouched"] = (run / "metrics.jsonl").read_bytes() == frozen_metrics
        seen["first_rank0"] = ranks[0]
        os.kill(ranks[1], signal.SIGKILL)
        os.kill(ranks[0], signal.SIGCONT)
        first.wait()
        remember_dead_attempt("second")

        # 2. kill both ranks while a checkpoint is being written
        second = launch("second")
        ranks = second.wait_for_ranks()
        head(second, "second")
        while True:
            saving = _wait_for(lambda: _checkpoints(run)[1], 240, "a checkpoint being written", 0.002)
            _freeze(ranks.values())
            if not (run / "checkpoints" / f"step_{saving[-1]:08d}" / "complete").exists():
                break
            for pid in ranks.values():  # it finished before the freeze: catch the next one
                os.kill(pid, signal.SIGCONT)
        seen["cut_short"] = saving[-1]
        for pid in ranks.values():
            os.kill(pid, signal.SIGKILL)
        second.wait()
        seen["second_lines"] = second.lines()  # all it printed before it died
        seen["second_rank0"] = ranks[0]
        remember_dead_attempt("third")

        # 3. kill the torchrun agent alone
        third = launch("third")
        ranks = third.wait_for_ranks()
        head(third, "third")
        start = max(_metrics(run), default=0)
        _wait_for(lambda: max(_metrics(run), default=0) >= start + 2, 240, "the relaunch to train")
        third.agent.kill()
        third.agent.wait()
        seen["third_lines"] = third.lines()
        gone = time.monotonic()
        seen["orphans"] = [pid for pid in ranks.values() if alive(pid)]
        while seen["orphans"] and time.monotonic() - gone < 10:
            time.sleep(0.05)
            seen["orphans"] = [pid for pid in ranks.values() if alive(pid)]
        after = (run / "metrics.jsonl").read_bytes()
        time.sleep(1)
        seen["quiet_after_agent"] = (run / "metrics.jsonl").read_bytes() == after
        seen["third_rank0"] = ranks[0]
        remember_dead_attempt("fourth")

        # 4. a relaunch that runs to the end
        fourth = launch("fourth")
        fourth.wait_for_ranks()
        seen["fourth_code"] = fourth.wait()
        seen["fourth_lines"] = fourth.lines()
        seen["fourth_err"] = fourth.err.read_text()
    finally:
        for started in launches:
            started.kill_everything()
    return run, overrides, seen


def test_a_second_job_on_the_run_directory_is_refused_on_every_rank(chain):
    _, _, seen = chain
    assert seen["refused_code"] != 0
    err = seen["refused_err"]
    owner = f"is owned by pid {seen['first_rank0']} on host {socket.gethostname()} (job tiny_sft"
    assert "python -m osvl.train: error: job.run_dir" in err and owner in err, err[-3000:]
    # every rank stopped with the refusal (exit 2), unless the agent's SIGTERM reached it first once another had
    # (that every rank learns the refusal is tested in tests/test_run_lock.py); nothing crashed or hung
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", err))
    assert "2" in codes and codes <= {"2", "-15"}, err[-3000:]
    assert seen["untouched"]  # and it wrote nothing


def test_relaunch_after_a_rank_was_killed(chain):
    _, _, seen = chain
    lines = seen["second_lines"]
    assert re.fullmatch(seen["expect_second"], lines[0]), (lines[0], seen["expect_second"])
    assert "metrics of steps" in lines[0] and "TensorBoard events" in lines[0]
    if seen["stale_second"] is None:  # rank 0 unwound on the collective error and released the lock
        assert not any(line.startswith("lock:") for line in lines)
    else:  # the agent's SIGTERM got there first
        assert seen["stale_second"] == seen["first_rank0"]
        assert lines[1].startswith(f"lock: took over the stale lock of pid {seen['first_rank0']} on host")


def test_relaunch_after_a_kill_during_a_save(chain):
    _, _, seen = chain
    line = seen["third_lines"][0]
    assert re.fullmatch(seen["expect_third"], line), (line, seen["expect_third"])
    assert f"checkpoints step_{seen['cut_short']:08d}" in line  # the half-written checkpoint is discarded, not used
    assert seen["stale_third"] == seen["second_rank0"]  # SIGKILL: no release
    assert seen["third_lines"][1].startswith(f"lock: took over the stale lock of pid {seen['second_rank0']}")


def test_killing_the_agent_leaves_no_orphans(chain):
    _, _, seen = chain
    assert seen["orphans"] == []
    assert seen["quiet_after_agent"]  # nothing kept writing the run directory
    line = seen["fourth_lines"][0]
    assert re.fullmatch(seen["expect_fourth"], line), (line, seen["expect_fourth"])
    assert seen["stale_fourth"] == seen["third_rank0"]
    assert seen["fourth_lines"][1].startswith(f"lock: took over the stale lock of pid {seen['third_rank0']}")


def test_every_step_recorded_once_with_the_values_dead_attempts_had(chain):
    run, _, seen = chain
    assert seen["fourth_code"] == 0, seen["fourth_err"][-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    final = _metrics(run)
    for step, losses in seen["dead"].items():
        assert all(loss == final[step] for loss in losses), (step, losses, final[step])  # resume is exact
    assert any(len(losses) > 1 for losses in seen["dead"].values())  # some steps were trained twice

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), purge_orphaned_data=False)  # no reader-side repair
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, STEPS + 1))
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([final[s] for s in range(1, STEPS + 1)])
    complete, incomplete = _checkpoints(run)
    assert complete[-1] == STEPS and incomplete == []
    assert not (run / LOCK_FILE).exists()
    assert seen["fourth_lines"][-1] == f"tiny_sft: {STEPS} steps, final loss {final[STEPS]:.4f}, run dir {run}"


def test_a_finished_run_says_so_and_reports_its_recorded_loss(chain, capsys, monkeypatch):
    run, overrides, _ = chain
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert train_main(["--recipe", "tiny_sft", *[a for o in overrides for a in ("--set", o)]]) == 0
    lines = capsys.readouterr().out.splitlines()
    loss = _metrics(run)[STEPS]
    assert lines[0] == (
        f"finished: {run}/checkpoints/step_{STEPS:08d} holds step {STEPS} of {STEPS} (policy version "
        f"{STEPS}); nothing left to train; recorded final loss {loss:.4f}; discarded nothing"
    )
    assert lines[-1] == (
        f"tiny_sft: {STEPS} steps (already finished: nothing trained), final loss {loss:.4f}, run dir {run}"
    )
