"""The GRPO stage's tool environment: the offline world backends in a spawned worker pool, with
optional injected faults so the demo and tests exercise fatal masking and the one-sided clamp."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from osvl.config.recipe import Recipe
from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools import (
    ImageSearchConfig,
    Job,
    PoolConfig,
    TextSearchConfig,
    ToolEnvironment,
    ToolPool,
    ToolsConfig,
    default_registry,
)
from osvl.tools.environment import ToolRunner

INJECTED = "injected fault"


class FaultInjectingRunner:
    """Turns a seeded fraction of successful tool results into ``tool_error`` (a policy-counted error).

    Faults hit finished calls, so the worker pool, deadlines and images are exercised as usual; the
    rate applies per call, so K consecutive faults (a fatal cascade) happen at rate**K.
    """

    def __init__(self, runner: ToolRunner, rate: float, seed: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must lie in [0, 1], got {rate}")
        self.runner, self.rate = runner, rate
        self._rng = random.Random(seed)
        self.injected = 0

    def _maybe_fault(self, result: ToolResult) -> ToolResult:
        if not result.ok or self._rng.random() >= self.rate:
            return result
        self.injected += 1
        return ToolResult(status=ToolStatus.TOOL_ERROR, tool=result.tool, error=INJECTED, elapsed_s=result.elapsed_s)

    def call(self, job: Job) -> ToolResult:
        return self._maybe_fault(self.runner.call(job))

    async def acall(self, job: Job) -> ToolResult:
        return self._maybe_fault(await self.runner.acall(job))


def world_tools_config(world_dir: str | Path) -> ToolsConfig:
    """Offline TextSearch (FTS5) over ``corpus.jsonl`` and ImageSearch over ``images.jsonl``."""
    root = Path(world_dir)
    corpus, collection = root / "corpus.jsonl", root / "images.jsonl"
    for path in (corpus, collection):
        if not path.is_file():
            raise ValueError(f"tools.world_dir: {root} has no {path.name}; build it with "
                             f"`python -m osvl.world build --out {root}`")
    return ToolsConfig(text_search=TextSearchConfig(corpus_path=str(corpus)),
                       image_search=ImageSearchConfig(collection_path=str(collection)))


EnvironmentFactory = Callable[[Recipe, int], AbstractContextManager[ToolEnvironment]]


@contextmanager
def world_environment(recipe: Recipe, rank: int) -> Iterator[ToolEnvironment]:
    """This rank's tool pool over the recipe's world, faults injected at ``tools.fault_rate``."""
    if recipe.tools.backend != "offline":
        raise ValueError("tools.backend: the grpo stage runs the offline world backends; online tools "
                         "are served by osvl.tools.server and not wired into the trainer yet")
    if not recipe.tools.world_dir:
        raise ValueError("tools.world_dir must name a world directory for the offline backends")
    config = world_tools_config(recipe.tools.world_dir)
    with ToolPool(config, PoolConfig(num_workers=recipe.tools.workers)) as pool:
        yield with_faults(ToolEnvironment(default_registry(config.limits), pool), recipe, rank)


def with_faults(env: ToolEnvironment, recipe: Recipe, rank: int) -> ToolEnvironment:
    """The same environment with ``tools.fault_rate`` injected (seeded by job seed and rank)."""
    if recipe.tools.fault_rate == 0.0:
        return env
    runner = FaultInjectingRunner(env.pool, recipe.tools.fault_rate, seed=recipe.job.seed * 1009 + rank)
    return ToolEnvironment(env.registry, runner, env.cache)
