"""Module-level builders that spawned engine servers and rollout workers import and call."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from bench.rollout.worker_pool import RolloutSetup
from osvl.rollout.agent import AgentConfig
from osvl.rollout.engine import SamplingParams
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.rollout.workers import RolloutWorkerConfig
from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer
from tests.rollout.inline_tools import inline_environment, renderer_for
from tests.rollout.scripts import scripted


class ForwardingEngine:
    """An engine that is ``inner`` except where a subclass intercepts ``generate``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def load_weights(self, state_dict, version: int) -> None:
        self.inner.load_weights(state_dict, version)

    async def generate(self, request):
        return await self.inner.generate(request)


class HangOnSeeds(ForwardingEngine):
    """Forwards to ``inner`` but never answers requests sampled with one of ``seeds``."""

    def __init__(self, inner, seeds: Sequence[int]) -> None:
        super().__init__(inner)
        self.seeds = set(seeds)

    async def generate(self, request):
        if request.sampling.seed in self.seeds:
            await asyncio.sleep(3600)
        return await super().generate(request)


def local_engine(max_batch: int = 8) -> LocalEngine:
    return LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, max_batch=max_batch)


def replay_engine(turns: Sequence[str], hang_seeds: Sequence[int] = ()) -> HangOnSeeds:
    return HangOnSeeds(ReplayEngine(local_engine(), scripted(turns)), hang_seeds)


def broken_engine():
    raise ValueError("no model here")


class DieOnPrompt(ForwardingEngine):
    """Kills its whole process (``crash``) or freezes its event loop (``freeze``) the first time it
    sees ``marker`` in a prompt; a file records that it happened, so the retry in a new process
    goes through."""

    def __init__(self, inner, marker: str, flag: str, mode: str) -> None:
        super().__init__(inner)
        self.marker, self.flag, self.mode = marker, Path(flag), mode

    async def generate(self, request):
        if self.marker in tokenizer().decode(request.input_ids) and not self.flag.exists():
            self.flag.touch()
            if self.mode == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # noqa: ASYNC251 - blocks the loop: only the group deadline ends it
        return await super().generate(request)


def rollout_setup(turns: Sequence[str], marker: str = "", flag: str = "", mode: str = "crash") -> RolloutSetup:
    env = inline_environment()
    engine = replay_engine(turns)
    return RolloutSetup(
        engine=DieOnPrompt(engine, marker, flag, mode) if marker else engine,
        env=env,
        renderer=renderer_for(env),
        agent=AgentConfig(max_turns=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=64)),
        rollout=RolloutWorkerConfig(group_size=2, max_in_flight=4, trajectory_deadline_s=60, max_retries=0),
    )
