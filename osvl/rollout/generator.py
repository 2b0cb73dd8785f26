"""The rollout generator of asynchronous GRPO: rolls groups out ahead of the trainer into the replay buffer.

The trainer's thread draws prompts (``Ticket``s) from the stream and takes each step's groups
(``next_batch``); the generator starts groups on its event loop, which runs while the trainer
trains (see :mod:`osvl.rollout.event_loop`), scores them as they finish, and keeps them in the
replay buffer (:mod:`osvl.rollout.replay`). At most ``(max_staleness + 1) x groups_per_step``
groups are running or waiting at a time, less the groups the trainer took since the last weight
update: with ``max_staleness = 0`` no group starts before the weights it will be trained from
serve (the synchronous step); with ``N >= 1`` the next steps' groups roll out while the trainer
trains. This is AReaL's bound, ``(N + version + 1) x batch - (accepted + running)``.

The trainer takes the oldest fresh groups as soon as a step's worth is scored, whatever is still
running, so a slow trajectory holds back only its own group; a group that went past the
staleness bound meanwhile is dropped and counted, or rolled out again (``stale_groups``).
``update_weights`` wraps every weight sync: under ``partial_rollouts = "restart"`` the
trajectories in flight are aborted first and start again on the new weights; under ``"keep"``
they go on (the sync pauses SGLang servers around the update; the in-process engine swaps its
weights between two batches).

``state_dict`` is the generator's part of a checkpoint: the buffer's groups as they are, and every
ticket drawn but not yet trained on (waiting or running). A resumed run rolls the running ones out
again from their prompts, with their seeds and tool faults, on the resumed weights.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from threading import Condition
from typing import Any, Literal, TypeVar

from osvl.rl.trajectory import Trajectory
from osvl.rollout.event_loop import EventLoopThread
from osvl.rollout.replay import ReplayBuffer, ScoredGroup, Ticket
from osvl.rollout.workers import Preemption

T = TypeVar("T")
GroupRollout = Callable[[Ticket, Preemption | None], Awaitable[list[Trajectory]]]  # rolls out and scores a group


@dataclass(frozen=True)
class GeneratorConfig:
    groups_per_step: int  # this rank's groups per training step
    max_staleness: int = 0  # weight syncs a trained group may lag the trainer
    updates_per_step: int = 1  # optimizer steps (policy versions) per weight sync
    stale_groups: Literal["drop", "regenerate"] = "drop"
    partial_rollouts: Literal["keep", "restart"] = "keep"

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or self.max_staleness < 0 or self.updates_per_step < 1:
            raise ValueError("groups_per_step and updates_per_step must be >= 1 and max_staleness >= 0")
        if self.stale_groups not in ("drop", "regenerate"):
            raise ValueError(f"stale_groups must be drop or regenerate, got {self.stale_groups!r}")
        if self.partial_rollouts not in ("keep", "restart"):
            raise ValueError(f"partial_rollouts must be keep or restart, got {self.partial_rollouts!r}")

    @property
    def capacity(self) -> int:
        """Groups running or waiting, at most."""
        return (self.max_staleness + 1) * self.groups_per_step


@dataclass
class GeneratorStats:
    """What happened since the last ``take_stats``."""

    stale: int = 0  # groups past the staleness bound (dropped or rolled out again)
    regenerated: int = 0
    wait_s: float = 0.0  # the trainer waiting for groups
    idle_s: float = 0.0  # no group rolling out
    elapsed_s: float = 0.0  # the time these stats cover
    dropped: list[ScoredGroup] = field(default_factory=list)  # the stale groups dropped (to record them)


class GroupsOverdue(TimeoutError):
    """``next_batch`` waited past its deadline; the message says for what (one line)."""


class GeneratorFailed(RuntimeError):
    """A group's rollout raised (a bug, or a cancellation the generator did not send): no step can come."""


class RolloutGenerator:
    """``start`` it, then per step ``next_batch`` -> train -> ``update_weights``; ``close`` when done.

    ``draw()`` returns this rank's tickets of the next prompt-stream batch; it is called only from
    the trainer's thread, so the stream's cursor and the tickets drawn are consistent in a checkpoint.
    """

    def __init__(
        self,
        config: GeneratorConfig,
        rollout: GroupRollout,
        loop: EventLoopThread,
        draw: Callable[[], list[Ticket]],
        version: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.config, self.rollout, self.loop, self.draw = config, rollout, loop, draw
        self.version = version  # the weights the engines serve (optimizer steps)
        self.buffer = ReplayBuffer(config.capacity, config.max_staleness, config.updates_per_step)
        self.pending: deque[Ticket] = deque()
        self.running: dict[Ticket, asyncio.Future] = {}
        self._started: dict[Ticket, float] = {}  # when each running group started
        self._taken = 0  # groups taken since the last weight update
        self._cond = Condition()
        self._stats = GeneratorStats()
        self._idle_since: float | None = time.monotonic()
        self._since = time.monotonic()  # the last take_stats
        self._error: BaseException | None = None
        self._closing = False  # close() cancels the groups running; any other cancellation is an error
        self._wake: asyncio.Event | None = None
        self._preemption: Preemption | None = None
        if state is not None:
            self._restore(state)

    # --- the trainer's thread ----------------------------------------------------------------------

    def start(self) -> None:
        self.loop.run(self._setup())
        self._top_up()
        self._wake_up()

    def next_batch(
        self,
        deadline_s: float | None = None,
        on_wait: Callable[[str], None] | None = None,
        every_s: float = 60.0,
    ) -> list[ScoredGroup]:
        """The step's groups, oldest first, all within the staleness bound of the current weights; past
        ``deadline_s`` seconds of waiting, :class:`GroupsOverdue` saying what it waited for. A wait that
        lasts is never silent: every ``every_s`` seconds ``on_wait`` gets the same report."""
        start = time.monotonic()
        n = self.config.groups_per_step
        next_report = every_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise GeneratorFailed(f"the rollout generator failed: {self._error!r}") from self._error
                for group in self.buffer.drop_stale(self.version):
                    self._retire(group)
                if len(self.buffer) >= n:
                    break
                waited = time.monotonic() - start
                if deadline_s is not None and waited > deadline_s:
                    self._stats.wait_s += waited
                    raise GroupsOverdue(self._waiting_for(waited))
                if on_wait is not None and waited >= next_report:
                    on_wait(self._waiting_for(waited))
                    next_report += every_s
                self._top_up()
                self._wake_up()
                until = [1.0, *([deadline_s - waited] if deadline_s is not None else [])]
                until += [next_report - waited] if on_wait is not None else []
                self._cond.wait(timeout=max(min(until), 0.01))
            groups = self.buffer.take(n)
            self._taken += n
            self._stats.wait_s += time.monotonic() - start
        return groups

    def update_weights(self, sync: Callable[[], T], version: int) -> T:
        """Runs ``sync`` (which makes the engines serve ``version``), restarting or keeping the
        trajectories in flight, then lets the generator start the groups the new weights allow."""
        restart = self.config.partial_rollouts == "restart" and self._preemption is not None
        if restart:
            self.loop.run(self._preempt())
        try:
            return sync()
        finally:
            with self._cond:
                self.version, self._taken = version, 0
            if restart:
                self.loop.call(self._preemption.end)
            self._top_up()
            self._wake_up()

    def take_stats(self) -> GeneratorStats:
        now = time.monotonic()
        with self._cond:
            stats, self._stats = self._stats, GeneratorStats()
            if self._idle_since is not None:
                stats.idle_s += now - self._idle_since
                self._idle_since = now
            stats.elapsed_s, self._since = now - self._since, now
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The buffer's groups, and the tickets drawn but not trained on (the running ones first)."""
        with self._cond:
            return {
                "version": self.version,
                "buffer": self.buffer.state_dict(),
                "pending": sorted(self.running) + list(self.pending),
            }

    def close(self) -> None:
        """Cancels the groups still running (their tickets stay in ``state_dict``)."""

        async def cancel() -> None:
            self._closing = True
            tasks = list(self.running.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._wake is not None:
            self.loop.run(cancel())

    # --- on both threads, under the lock -----------------------------------------------------------

    def _waiting_for(self, waited: float) -> str:
        now = time.monotonic()
        oldest = max((now - t for t in self._started.values()), default=0.0)
        return (
            f"waited {waited:.0f} s for {self.config.groups_per_step} scored groups of policy version {self.version}: "
            f"{len(self.buffer)} scored, {len(self.running)} rolling out (the oldest for {oldest:.0f} s), "
            f"{len(self.pending)} waiting to start, {self.config.capacity - self._taken} allowed"
        )

    def _allowed(self) -> int:
        """Groups that may be running or waiting now."""
        return self.config.capacity - self._taken

    def _top_up(self) -> None:
        """Draws prompts one stream batch ahead of the allowance, so the generator has work the moment
        a weight sync allows more."""
        with self._cond:
            while (
                len(self.pending) + len(self.running) + len(self.buffer)
                < self.config.capacity + self.config.groups_per_step
            ):
                tickets = self.draw()
                if not tickets:
                    raise ValueError("the prompt stream returned no tickets")
                self.pending.extend(tickets)

    def _retire(self, group: ScoredGroup) -> None:
        """A group past the staleness bound: dropped, or its prompt rolled out again first."""
        self._stats.stale += 1
        if self.config.stale_groups == "regenerate":
            self.pending.appendleft(group.ticket.regenerated())
            self._stats.regenerated += 1
        else:
            self._stats.dropped.append(group)

    def _wake_up(self) -> None:
        if self._wake is not None:
            self.loop.call(self._wake.set)

    def _restore(self, state: dict[str, Any]) -> None:
        if state["version"] != self.version:
            raise ValueError(
                f"the rollout generator's state is of policy version {state['version']}, the resumed "
                f"weights are version {self.version}"
            )
        if len(state["buffer"]["groups"]) > self.config.capacity:
            raise ValueError(
                f"the checkpoint's replay buffer holds {len(state['buffer']['groups'])} groups, more than "
                f"rollout.max_staleness = {self.config.max_staleness} allows ({self.config.capacity})"
            )
        self.buffer.load_state_dict(state["buffer"])
        self.pending.extend(state["pending"])

    # --- the event loop ----------------------------------------------------------------------------

    async def _setup(self) -> None:
        self._wake = asyncio.Event()
        if self.config.partial_rollouts == "restart":
            self._preemption = Preemption()
        asyncio.ensure_future(self._admit_forever())

    async def _admit_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._cond:
                while self.pending and len(self.running) + len(self.buffer) < self._allowed():
                    ticket = self.pending.popleft()
                    self._set_running(ticket, asyncio.ensure_future(self._roll(ticket)))

    def _set_running(self, ticket: Ticket, task: asyncio.Future | None) -> None:
        now = time.monotonic()
        if task is not None:
            if not self.running and self._idle_since is not None:
                self._stats.idle_s += now - self._idle_since
                self._idle_since = None
            self.running[ticket] = task
            self._started[ticket] = now
            return
        del self.running[ticket]
        del self._started[ticket]
        if not self.running:
            self._idle_since = now

    async def _roll(self, ticket: Ticket) -> None:
        try:
            trajectories = await self.rollout(ticket, self._preemption)
        except asyncio.CancelledError as cancelled:
            if self._closing:
                raise
            # cancelled from inside (a library's leaked cancellation): the group would stay "running" forever
            self._fail(RuntimeError(f"the rollout of {ticket} was cancelled before it finished: {cancelled!r}"))
            return
        except Exception as error:  # noqa: BLE001 - a bug surfaces in the trainer's next_batch, not as a hang
            self._fail(error)
            return
        group = ScoredGroup(ticket, trajectories)
        with self._cond:
            self._set_running(ticket, None)
            if self.buffer.is_fresh(group, self.version):
                self.buffer.put(group)
            else:  # already past the bound: it would only wait to be dropped
                self._retire(group)
            self._cond.notify_all()
        self._wake.set()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    async def _preempt(self) -> None:
        self._preemption.begin()
