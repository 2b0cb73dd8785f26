"""The embedded mini-world: a seeded, generated closed world (graph, text corpus, images)."""

from osvl.world.build import (
    ImageRecord,
    SamplingDefaults,
    World,
    build_world,
    graph_world,
    load_world,
)
from osvl.world.generate import WorldConfig
from osvl.world.graph import (
    DOMAINS,
    Graph,
    ImageRef,
    Link,
    Page,
    iter_pages,
    write_pages,
)

__all__ = [
    "DOMAINS",
    "Graph",
    "ImageRecord",
    "ImageRef",
    "Link",
    "Page",
    "SamplingDefaults",
    "World",
    "WorldConfig",
    "build_world",
    "graph_world",
    "iter_pages",
    "load_world",
    "write_pages",
]
