"""The offline tools over a world: FTS5 TextSearch over its corpus, ImageSearch over its images.

A world is a directory laid out by ``python -m osvl.world build`` (``corpus.jsonl`` and
``images.jsonl``: what the training recipes' ``tools.world_dir`` and the tool server's ``--world``
name) or a loaded :class:`osvl.world.World`, whose manifest names its files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from osvl.tools.catalog import default_registry
from osvl.tools.config import ImageSearchConfig, TextSearchConfig, ToolBackendsConfig
from osvl.tools.environment import ToolEnvironment
from osvl.tools.limits import ToolLimits
from osvl.tools.pool import PoolConfig, ToolPool

if TYPE_CHECKING:
    from osvl.world.build import World


def world_files(world: str | os.PathLike[str] | World) -> tuple[Path, Path, Path]:
    """``(root, corpus, image collection)`` of a world directory or a loaded world."""
    if isinstance(world, (str, os.PathLike)):
        root = Path(world)
        return root, root / "corpus.jsonl", root / "images.jsonl"
    return Path(world.root), Path(world.corpus_path), Path(world.images_path)


def world_tools_config(
    world: str | os.PathLike[str] | World, index_path: str | Path | None = None, limits: ToolLimits | None = None
) -> ToolBackendsConfig:
    """Offline back-ends over the world's files; the FTS5 index goes to ``index_path`` (default:
    beside the corpus), built on first use and rebuilt when the corpus changes."""
    root, corpus, collection = world_files(world)
    for path in (corpus, collection):
        if not path.is_file():
            raise ValueError(
                f"world {root} has no {path.name}; build it with `python -m osvl.world build --out {root}`"
            )
    return ToolBackendsConfig(
        limits=limits or ToolLimits(),
        text_search=TextSearchConfig(
            corpus_path=str(corpus), index_path=None if index_path is None else str(index_path)
        ),
        image_search=ImageSearchConfig(collection_path=str(collection)),
    )


@contextmanager
def world_environment(
    world: str | os.PathLike[str] | World,
    pool: PoolConfig | None = None,
    index_path: str | Path | None = None,
    limits: ToolLimits | None = None,
    config: ToolBackendsConfig | None = None,
) -> Iterator[ToolEnvironment]:
    """osvl's tools in a spawned pool over the world (or over ``config``'s back-ends, e.g. online
    search) for the duration of the block, every tool preloaded (start-up takes seconds: share one
    environment across many episodes)."""
    config = config or world_tools_config(world, index_path, limits)
    registry = default_registry(config.limits)
    pool = pool or PoolConfig(num_workers=2)
    with ToolPool(config, replace(pool, preload=pool.preload or registry.targets())) as tool_pool:
        yield ToolEnvironment(registry, tool_pool)
