"""The GRPO stage's rollout side: prompt tickets from the stream, a group rolled out and scored, the generator.

Every data-parallel rank draws the same prompt-stream batches and rolls out its strided share of
each (whole groups), on its own rollout generator (:mod:`osvl.rollout.generator`), which runs on
the stage's event-loop thread while the rank trains. A group is judged as soon as its G samples
are final, so what reaches the replay buffer is scored and advantage-ready. A group's sampling
seeds and injected tool faults follow from its ticket (stream batch, position), so the synchronous
run (``rollout.max_staleness = 0``) rolls out exactly what it did before the generator existed,
and a resumed run rolls a group out the way the interrupted one did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.rl.scoring import GroupScorer
from osvl.rl.trajectory import Prompt, Trajectory
from osvl.rollout import Preemption, RolloutMetrics, run_group
from osvl.rollout.event_loop import EventLoopThread
from osvl.rollout.generator import GeneratorConfig, RolloutGenerator
from osvl.rollout.replay import Ticket
from osvl.serve.engines import Serving
from osvl.tools import ToolEnvironment
from osvl.trainer.grpo_data import rank_share, rollout_configs
from osvl.trainer.index_stream import IndexStream
from osvl.trainer.tool_env import step_faults


def ticket_source(stream: IndexStream, dp_size: int, dp_rank: int) -> Callable[[], list[Ticket]]:
    """This rank's tickets of the next prompt-stream batch, numbered by batch from the stream's cursor."""
    cursor = stream.cursor  # batches drawn so far: whole epochs of steps_per_epoch, then this epoch's
    state = {"batch": cursor.epoch * stream.steps_per_epoch + cursor.index // stream.global_batch}

    def draw() -> list[Ticket]:
        batch, index = stream.next_batch(), state["batch"]
        state["batch"] += 1
        return [Ticket(index, position, prompt) for position, prompt in rank_share(batch, dp_size, dp_rank)]

    return draw


class GroupRoller:
    """Rolls out one ticket's group through the serving engine and the rank's tools, then scores it.
    ``metrics`` collects the rank's rollout counts (turns, tool calls, retries, restarts)."""

    def __init__(
        self,
        recipe: Recipe,
        prompts: Sequence[Prompt],
        serving: Serving,
        env: ToolEnvironment,
        scorer: GroupScorer,
        renderer: ChatRenderer,
        rank: int,
    ) -> None:
        self.recipe, self.prompts, self.serving, self.env = recipe, prompts, serving, env
        self.scorer, self.renderer, self.rank = scorer, renderer, rank
        self.agent, self.workers = rollout_configs(recipe)
        self.metrics = RolloutMetrics()
        self._slots: asyncio.Semaphore | None = None  # trajectories in flight on this rank, across groups

    async def __call__(self, ticket: Ticket, preemption: Preemption | None) -> list[Trajectory]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers.max_in_flight)
        env = step_faults(self.env, self.recipe.job.seed, ticket.batch, self.rank)
        group = await run_group(
            self.prompts[ticket.prompt_index],
            ticket.position,
            self.serving.engine,
            env,
            self.renderer,
            self.agent,
            self.workers,
            step=ticket.batch,
            slots=self._slots,
            metrics=self.metrics,
            preemption=preemption,
        )
        for trajectory in group.trajectories:
            self.metrics.record(trajectory)
        return await self.scorer.score_group(group.trajectories)

    async def take_restarts(self) -> int:
        """Trajectories restarted by weight updates since the last call (run on the rollouts' loop)."""
        restarts, self.metrics.restarts = self.metrics.restarts, 0
        return restarts


def stage_generator(
    recipe: Recipe,
    roller: GroupRoller,
    loop: EventLoopThread,
    stream: IndexStream,
    dp_size: int,
    dp_rank: int,
    version: int,
    state: dict | None,
) -> RolloutGenerator:
    """The rank's generator over its share of the prompt stream, restored from ``state`` on a resume."""
    g, r = recipe.grpo, recipe.rollout
    config = GeneratorConfig(
        groups_per_step=g.batch_prompts // dp_size,
        max_staleness=r.max_staleness,
        updates_per_step=g.batch_prompts // g.mini_batch_prompts,
        stale_groups=r.stale_groups,
        partial_rollouts=r.partial_rollouts,
    )
    return RolloutGenerator(config, roller, loop, ticket_source(stream, dp_size, dp_rank), version, state)
