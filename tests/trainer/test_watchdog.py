"""No silent hang, on 2 trainer ranks: a rank whose step's groups cannot come stops the run with every
rank together, one line, the last finished step's checkpoint written and the relaunch resuming from it;
the deadlines themselves follow from the recipe.

The stall reproduced: after step 1, rank 1's rollouts end in a cancellation the generator did not send.
Its group stayed "running" with nothing in flight, rank 1 waited in ``next_batch`` for it and rank 0 in
the step's all-gather for rank 1, both at 0 % CPU, until killed (the stacks the hang was reported with).
The same when a rank's groups take longer than the recipe allows: it waits out the deadline, says what
for, and every rank stops."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from osvl.config import load_recipe
from osvl.trainer import read_metrics
from osvl.trainer.checkpoint import latest_checkpoint
from osvl.trainer.watchdog import AFTER_ROLLOUT_S, SLACK_S, collective_timeout_s, judge_verdict_s, step_deadline_s
from tests.parallel.harness import free_port, run_ranks
from tests.trainer.test_grpo import grpo_overrides

STALL_LIMIT_S = 240  # what the harness allows a stalled run before calling it a hang


class StalledAfterStepOne:
    """The scripted policy; on rank ``stalled``, once it serves the weights of step 1's update (the first policy
    version above the initial one: step 2's rollouts, in the synchronous loop), every generation either raises a
    cancellation nobody sent (``mode = "cancelled"``) or never returns (``"stuck"``). Keyed on the version, not on
    rank 0's metrics file, which under load could be written after rank 1 had already rolled out step 2."""

    def __init__(self, local, rank: int, stalled: int, mode: str) -> None:
        from tests.trainer.grpo_fixtures import scripted

        self.inner, self.rank, self.stalled, self.mode = scripted(local), rank, stalled, mode
        self.initial_version = self.inner.policy_version

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def load_weights(self, state_dict, version: int) -> None:
        self.inner.load_weights(state_dict, version)

    async def generate(self, request):
        if self.rank == self.stalled and self.inner.policy_version > self.initial_version:
            if self.mode == "cancelled":
                raise asyncio.CancelledError("a client library's own timeout, leaked")
            await asyncio.Event().wait()
        return await self.inner.generate(request)


def stalled_body(rank: int, world: int, port: int, overrides: list[str], mode: str, out: str) -> None:
    import functools

    import torch
    import torch.distributed as dist

    from osvl.parallel import teardown, use_host_device
    from osvl.trainer import run_grpo
    from osvl.trainer.watchdog import RunStopped
    from tests.trainer.grpo_fixtures import echo_environment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    use_host_device()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    recipe = load_recipe("tiny_grpo", overrides)
    wrapper = functools.partial(StalledAfterStepOne, rank=rank, stalled=1, mode=mode)
    code, line = 0, ""
    try:
        run_grpo(recipe, rank, world, environment=echo_environment, engine_wrapper=wrapper)
    except RunStopped as stopped:
        code, line = 1, str(stopped)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"code": code, "line": line}))
    teardown()
    os._exit(code)


def run_stalled(tmp_path: Path, mode: str, *extra: str) -> tuple[list[dict], float, list[str]]:
    """Both ranks' exit records and the seconds they took (a hang is killed at STALL_LIMIT_S and fails)."""
    overrides = grpo_overrides(tmp_path, tmp_path / "run", "grpo.max_steps=3", *extra)
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=stalled_body, args=(r, 2, port, overrides, mode, str(tmp_path))) for r in range(2)]
    started = time.monotonic()
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(max(1.0, STALL_LIMIT_S - (time.monotonic() - started)))
    seconds = time.monotonic() - started
    hung = [p for p in ranks if p.is_alive()]
    for p in hung:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert not hung, f"ranks {[ranks.index(p) for p in hung]} still waiting after {seconds:.0f} s: a silent hang"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)], seconds, overrides


@pytest.mark.slow
def test_a_rank_whose_rollouts_were_cancelled_stops_every_rank_with_a_checkpoint(tmp_path):
    exits, seconds, overrides = run_stalled(tmp_path, "cancelled", "rollout.step_deadline_s=60")
    assert [e["code"] for e in exits] == [1, 1], exits
    assert exits[0]["line"] == exits[1]["line"] and seconds < 120
    line = exits[0]["line"]
    assert line.startswith("step 2: the rollouts did not arrive (rank 1: the rollout generator failed"), line
    assert "was cancelled before it finished" in line and "checkpoint of step 1 written" in line, line
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_00000001"
    # the relaunch resumes from it and finishes
    relaunch = [o for o in overrides if not o.startswith("grpo.max_steps")] + ["grpo.max_steps=2"]
    run_ranks(grpo_resume_body, 2, relaunch)
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]


def grpo_resume_body(rank: int, world: int, overrides: list[str]) -> None:
    from osvl.trainer import run_grpo
    from tests.trainer.grpo_fixtures import echo_environment, scripted

    result = run_grpo(
        load_recipe("tiny_grpo", overrides), rank, world, environment=echo_environment, engine_wrapper=scripted
    )
    assert result.steps == 2 and result.resumed_from == 1, result


@pytest.mark.slow
def test_a_rank_waiting_past_the_deadline_says_what_for_and_every_rank_stops(tmp_path):
    exits, seconds, _ = run_stalled(tmp_path, "stuck", "rollout.step_deadline_s=8", "rollout.trajectory_deadline_s=600")
    assert [e["code"] for e in exits] == [1, 1], exits
    line = exits[0]["line"]
    assert line.startswith("step 2: the rollouts did not arrive (rank 1: waited 8 s for 2 scored groups"), line
    assert "rolling out (the oldest for" in line and "tools: local workers; judges:" in line, line
    assert "rank 0" not in line and seconds < 120  # rank 0 had its groups: it waited in the all-gather


def test_deadlines_follow_from_the_recipe():
    recipe = load_recipe("tiny_grpo_services")
    r, g = recipe.rollout, recipe.grpo
    per_rank = g.batch_prompts // 2 * g.group_size
    waves = -(-per_rank // r.max_in_flight)
    expected = waves * r.trajectory_deadline_s * (r.max_retries + 1) + 2 * judge_verdict_s(recipe) + SLACK_S
    assert step_deadline_s(recipe, 2) == pytest.approx(expected)
    assert collective_timeout_s(recipe, 2) == pytest.approx(expected + AFTER_ROLLOUT_S)
    manual = load_recipe("tiny_grpo_services", ["rollout.step_deadline_s=30", "job.collective_timeout_s=100"])
    assert (step_deadline_s(manual, 2), collective_timeout_s(manual, 2)) == (30, 100)
    assert collective_timeout_s(load_recipe("tiny_sft"), 2) == AFTER_ROLLOUT_S
    more_ranks = load_recipe("tiny_grpo_services", ["rollout.max_in_flight=2"])
    assert step_deadline_s(more_ranks, 1) > step_deadline_s(more_ranks, 2)  # more trajectories per rank, more waves
    from osvl.train import dry_run

    lines = dry_run(manual)  # the dry run states both
    assert "watchdog: a collective fails after 100 s (job.collective_timeout_s)" in lines
    assert any(line.startswith("watchdog: a rank waits at most 30 s for its step's groups") for line in lines)
    with pytest.raises(ValueError, match="step_deadline_s"):
        load_recipe("tiny_grpo", ["rollout.step_deadline_s=-1"])
