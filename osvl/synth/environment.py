"""The real tool environment over a world: offline backends pointed at its corpus and images.

``EnvironmentTools`` adapts ``osvl.tools.ToolEnvironment`` to the synthesis :data:`ToolExecutor`
(one call plus the episode's images in, a typed ``ToolResult`` out), so the scripted expert, the
chat expert and the staged-filter solvers run the same tools, worker pool and deadlines as RL
rollouts: FTS5 TextSearch over ``corpus.jsonl``, pHash/ORB ImageSearch over ``images.jsonl``,
rapidocr, the repair tools.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from osvl.rl.trajectory import ToolCall, ToolResult, ToolStatus
from osvl.tools import (
    ImageSearchConfig,
    PoolConfig,
    TextSearchConfig,
    ToolEnvironment,
    ToolLimits,
    ToolPool,
    ToolsConfig,
    VisualContext,
    default_registry,
)
from osvl.world.build import World


def world_tools_config(world: World, index_path: str | Path | None = None,
                       limits: ToolLimits | None = None) -> ToolsConfig:
    """Offline backends over the world's files; the FTS5 index goes to ``index_path`` (default:
    beside the corpus), built on first use and rebuilt when the corpus changes."""
    corpus, collection = Path(world.corpus_path), Path(world.images_path)
    for path in (corpus, collection):
        if not path.is_file():
            raise ValueError(f"world {world.root} has no {path.name}; build it with `python -m osvl.world build`")
    return ToolsConfig(
        limits=limits or ToolLimits(),
        text_search=TextSearchConfig(corpus_path=str(corpus), index_path=None if index_path is None else str(index_path)),
        image_search=ImageSearchConfig(collection_path=str(collection)),
    )


@dataclass
class EnvironmentTools:
    """A :data:`ToolExecutor` over a tool environment; a crashing environment is an ``infra_error``."""

    env: ToolEnvironment

    def __call__(self, call: ToolCall, images: list[np.ndarray]) -> ToolResult:
        try:
            context = VisualContext(images, self.env.registry.limits)
            return self.env.execute_sync(call, context)
        except Exception as error:  # noqa: BLE001 - errors are data: the episode records it and goes on
            return ToolResult(ToolStatus.INFRA_ERROR, call.name, error=f"tool environment failed: {error!r}")


@contextmanager
def world_environment(world: World, pool: PoolConfig | None = None, index_path: str | Path | None = None,
                      limits: ToolLimits | None = None, config: ToolsConfig | None = None
                      ) -> Iterator[EnvironmentTools]:
    """Spawn a tool pool over the world (or over ``config``'s backends, e.g. online search) for the
    duration of the block (start-up takes seconds: share one across many episodes)."""
    config = config or world_tools_config(world, index_path, limits)
    registry = default_registry(config.limits)
    with ToolPool(config, pool or PoolConfig(num_workers=2, preload=registry.targets())) as tool_pool:
        yield EnvironmentTools(ToolEnvironment(registry, tool_pool))
