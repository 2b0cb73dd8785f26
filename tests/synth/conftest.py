"""The default mini-world and one full curation run over it, shared by the pipeline tests."""

from __future__ import annotations

import pytest

from osvl.synth.environment import EnvironmentTools
from osvl.synth.pipeline import CurationConfig, curate
from osvl.tools import PoolConfig
from osvl.tools.world import world_environment
from osvl.world import WorldConfig, build_world, load_world


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    build_world(root, WorldConfig(seed=0))
    return load_world(root)


@pytest.fixture(scope="session")
def curated(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("curated")
    counts = curate(world, out, CurationConfig(seed=0))
    return out, counts


@pytest.fixture(scope="session")
def real_tools(world, tmp_path_factory):
    """The real tool pool over the world, spawned once (start-up and the per-worker index builds
    take seconds); one worker: the tests call it sequentially."""
    index = tmp_path_factory.mktemp("fts") / "corpus.fts5.sqlite"
    with world_environment(world, PoolConfig(num_workers=1, max_queue=8), index_path=index) as env:
        yield EnvironmentTools(env)
