"""The rollout generator against a scripted group rollout: what it admits under the bound (N = 0 is the
synchronous step, N = 1 rolls the next step out meanwhile), a slow group that does not hold the
step back, stale groups dropped or rolled out again, restarts at a weight update, failures, and its
checkpoint state."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from osvl.rl.trajectory import FinishReason, Prompt, Step, Trajectory
from osvl.rollout.event_loop import EventLoopThread
from osvl.rollout.generator import GeneratorConfig, GroupsOverdue, RolloutGenerator
from osvl.rollout.replay import Ticket

PER_STEP = 2  # groups per step (this rank)


class Stream:
    """Draws stream batches of PER_STEP tickets; ``drawn`` counts them."""

    def __init__(self) -> None:
        self.drawn = 0

    def __call__(self) -> list[Ticket]:
        batch, self.drawn = self.drawn, self.drawn + 1
        return [Ticket(batch, p, prompt_index=batch * PER_STEP + p) for p in range(PER_STEP)]


class Rollout:
    """A group is one trajectory of one step stamped with the engine version at its start; ``hold``
    tickets wait for their event; ``started`` records every start in order."""

    def __init__(self) -> None:
        self.version = 0  # what the "engine" serves
        self.started: list[Ticket] = []
        self.hold: dict[Ticket, threading.Event] = {}
        self.fail: Ticket | None = None
        self.cancel: Ticket | None = None  # raises CancelledError from inside, as a leaked cancellation would

    async def __call__(self, ticket: Ticket, preemption) -> list[Trajectory]:
        self.started.append(ticket)
        version = self.version
        if ticket in self.hold:
            await asyncio.to_thread(self.hold[ticket].wait, 60)
        if ticket == self.fail:
            raise KeyError("bug in the rollout")
        if ticket == self.cancel:
            raise asyncio.CancelledError("a library cancelled its own wait")
        step = Step([1, 2], [0.0, 0.0], policy_version=version)
        return [
            Trajectory(
                Prompt(f"p{ticket.prompt_index}", "q", answer="a"), [step], FinishReason.RESPONSE, ticket.position, 0
            )
        ]


def started(rollout: Rollout) -> list[tuple[int, int]]:
    return [(t.batch, t.position) for t in rollout.started]


def settle(loop: EventLoopThread, generator: RolloutGenerator, running: int = 0) -> None:
    """Waits until the loop has started what it may and at most ``running`` groups still roll out."""
    for _ in range(2000):
        loop.run(asyncio.sleep(0.005))
        with generator._cond:
            if len(generator.running) <= running and not (
                generator.pending and len(generator.running) + len(generator.buffer) < generator._allowed()
            ):
                return
    raise AssertionError("the generator did not settle")


def make(
    rollout: Rollout, loop: EventLoopThread, stream: Stream, version: int = 0, state=None, **config
) -> RolloutGenerator:
    generator = RolloutGenerator(
        GeneratorConfig(groups_per_step=PER_STEP, **config), rollout, loop, stream, version, state
    )
    generator.start()
    return generator


def update(generator: RolloutGenerator, rollout: Rollout, version: int) -> None:
    def sync():
        rollout.version = version

    generator.update_weights(sync, version)


def test_synchronous_generator_rolls_out_one_step_on_the_weights_it_trains_from():
    rollout, stream = Rollout(), Stream()
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream)
        settle(loop, generator)
        assert started(rollout) == [(0, 0), (0, 1)]  # one step's groups, no more
        batch = generator.next_batch()
        assert [g.ticket for g in batch] == [Ticket(0, 0, 0), Ticket(0, 1, 1)]
        settle(loop, generator)
        assert len(rollout.started) == 2  # nothing starts while the trainer trains on version 0
        update(generator, rollout, 2)
        settle(loop, generator)
        assert started(rollout)[2:] == [(1, 0), (1, 1)]
        assert all(g.version == 2 for g in generator.next_batch())
        generator.close()


def test_one_step_of_staleness_rolls_the_next_step_out_while_training():
    rollout, stream = Rollout(), Stream()
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream, max_staleness=1, updates_per_step=2)
        settle(loop, generator)
        assert started(rollout) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # two steps' worth on version 0
        assert [g.ticket.batch for g in generator.next_batch()] == [0, 0]
        update(generator, rollout, 2)
        settle(loop, generator)
        assert started(rollout)[4:] == [(2, 0), (2, 1)]  # the sync allows the step after next
        batch = generator.next_batch()
        assert [(g.ticket.batch, g.version) for g in batch] == [(1, 0), (1, 0)]  # one sync old: within the bound
        stats = generator.take_stats()
        assert stats.stale == 0 and stats.wait_s >= 0 and stats.elapsed_s > 0
        generator.close()


def test_a_slow_group_does_not_hold_the_step_and_is_dropped_past_the_bound():
    rollout, stream = Rollout(), Stream()
    slow = Ticket(0, 0, 0)
    rollout.hold[slow] = threading.Event()
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream, max_staleness=1, updates_per_step=1)
        steps = []
        for version in (1, 2):  # two steps complete while the slow group is held
            settle(loop, generator, running=1)
            steps.append([g.ticket for g in generator.next_batch()])
            update(generator, rollout, version)
        assert slow not in steps[0] + steps[1] and steps[0] == [Ticket(0, 1, 1), Ticket(1, 0, 2)]
        rollout.hold[slow].set()  # it finishes now, two syncs after it started
        settle(loop, generator)
        stats = generator.take_stats()
        assert stats.stale == 1 and [g.ticket for g in stats.dropped] == [slow] and stats.regenerated == 0
        assert all(g.ticket != slow for g in generator.next_batch())
        generator.close()


def test_a_stale_group_is_rolled_out_again_first():
    rollout, stream = Rollout(), Stream()
    slow = Ticket(0, 0, 0)
    rollout.hold[slow] = threading.Event()
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream, max_staleness=1, stale_groups="regenerate")
        for version in (1, 2):
            settle(loop, generator, running=1)
            generator.next_batch()
            update(generator, rollout, version)
        rollout.hold[slow].set()
        settle(loop, generator)  # the slow group is retired, its prompt rolled out again
        assert generator.take_stats().regenerated == 1
        assert slow.regenerated() in rollout.started  # the prompt again, on version 2
        batch = generator.next_batch()
        again = [g for g in batch if g.ticket == slow.regenerated()]
        assert again and again[0].version == 2
        generator.close()


def test_checkpoint_state_holds_the_buffer_and_every_ticket_not_trained_on():
    rollout, stream = Rollout(), Stream()
    held = Ticket(1, 1, 3)
    rollout.hold[held] = threading.Event()
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream, max_staleness=1)
        settle(loop, generator, running=1)
        generator.next_batch()
        state = generator.state_dict()
        generator.close()
        rollout.hold[held].set()  # its cancelled rollout's thread ends
    assert [ticket for ticket, _ in state["buffer"]["groups"]] == [Ticket(1, 0, 2)]
    assert state["pending"][0] == held  # running: rolled out again on a resume
    assert {t.batch for t in state["pending"][1:]} == {2}  # drawn ahead, not started
    assert state["version"] == 0
    resumed, again = Rollout(), Stream()
    again.drawn = stream.drawn  # the stream's cursor is restored from the same checkpoint
    with EventLoopThread() as loop:
        generator = make(resumed, loop, again, state=state, max_staleness=1)
        settle(loop, generator)
        batch = generator.next_batch()
        assert [g.ticket for g in batch] == [Ticket(1, 0, 2), held]  # the buffered group as it was, then the held one
        assert started(resumed)[0] == (1, 1)  # the running ticket first, then the drawn ones
        generator.close()
    with pytest.raises(ValueError, match="policy version 0, the resumed weights are version 2"):
        RolloutGenerator(GeneratorConfig(groups_per_step=PER_STEP), Rollout(), None, Stream(), 2, state)
    crowded = {**state, "buffer": {"groups": state["buffer"]["groups"] * 3}}
    with pytest.raises(ValueError, match="holds 3 groups, more than rollout.max_staleness = 0 allows"):
        RolloutGenerator(GeneratorConfig(groups_per_step=1), Rollout(), None, Stream(), 0, crowded)


def test_a_failing_rollout_surfaces_in_next_batch():
    rollout, stream = Rollout(), Stream()
    rollout.fail = Ticket(0, 1, 1)
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream)
        with pytest.raises(RuntimeError, match="rollout generator failed: KeyError"):
            generator.next_batch()
        generator.close()


def test_a_group_cancelled_from_inside_is_an_error_not_a_group_running_forever():
    """A CancelledError out of the rollout that the generator did not send left the ticket "running": the
    step waited for it forever with nothing in flight."""
    rollout, stream = Rollout(), Stream()
    rollout.cancel = Ticket(0, 0, 0)
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream)
        with pytest.raises(RuntimeError, match="rollout of Ticket.*was cancelled before it finished"):
            generator.next_batch(deadline_s=30)
        generator.close()


def test_past_its_deadline_next_batch_says_what_it_waited_for():
    rollout, stream = Rollout(), Stream()
    rollout.hold[Ticket(0, 1, 1)] = threading.Event()  # one of the step's two groups never arrives
    with EventLoopThread() as loop:
        generator = make(rollout, loop, stream)
        started_at = time.monotonic()
        reports: list[str] = []
        with pytest.raises(GroupsOverdue) as late:
            generator.next_batch(deadline_s=0.5, on_wait=reports.append, every_s=0.2)
        assert 0.5 <= time.monotonic() - started_at < 5
        assert len(reports) == 2 and all("1 scored, 1 rolling out" in r for r in reports)  # at 0.2 and 0.4 s
        report = str(late.value)
        assert "for 2 scored groups of policy version 0: 1 scored, 1 rolling out (the oldest for" in report, report
        rollout.hold[Ticket(0, 1, 1)].set()
        assert len(generator.next_batch(deadline_s=30)) == 2  # the same step, once the group arrives
        generator.close()


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="groups_per_step"):
        GeneratorConfig(groups_per_step=0)
    with pytest.raises(ValueError, match="stale_groups"):
        GeneratorConfig(groups_per_step=1, stale_groups="keep")
    with pytest.raises(ValueError, match="partial_rollouts"):
        GeneratorConfig(groups_per_step=1, partial_rollouts="finish")


def test_restart_mode_rolls_the_trajectories_in_flight_out_again_on_the_new_weights(env, renderer):
    """The generator with the real rollout workers: a weight update under partial_rollouts = "restart"
    aborts the samples in flight; they start again once the new weights serve, so no trajectory
    mixes versions."""
    from osvl.rollout import AgentConfig, LocalEngine, ReplayEngine, RolloutMetrics, RolloutWorkerConfig, SamplingParams
    from osvl.rollout.workers import run_group
    from tests.rollout.helpers import IMAGE_CONFIG, prompts, tiny_model, tokenizer
    from tests.rollout.scripts import respond, scripted
    from tests.rollout.test_workers import HeldEngine

    local = LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG)
    engine = HeldEngine(ReplayEngine(local, scripted([respond()])))
    agent = AgentConfig(max_turns=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=32))
    metrics = RolloutMetrics()

    async def rollout(ticket, preemption):
        group = await run_group(
            prompts(1)[0],
            ticket.position,
            engine,
            env,
            renderer,
            agent,
            RolloutWorkerConfig(group_size=2),
            step=ticket.batch,
            metrics=metrics,
            preemption=preemption,
        )
        return group.trajectories

    with EventLoopThread() as loop:
        generator = make(rollout, loop, Stream(), partial_rollouts="restart")
        while engine.calls < 2 * PER_STEP:  # every sample of the step is generating on version 0
            loop.run(asyncio.sleep(0.01))

        def sync():
            local.load_weights(local.model.state_dict(), 2)
            engine.held = False

        generator.update_weights(sync, 2)
        batch = generator.next_batch()
        generator.close()
    assert metrics.restarts == 2 * PER_STEP
    assert all(s.policy_version == 2 and not s.token_versions for g in batch for t in g.trajectories for s in t.steps)
