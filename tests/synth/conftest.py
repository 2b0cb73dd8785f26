"""The default mini-world and one full curation run over it, shared by the pipeline tests."""

from __future__ import annotations

import pytest

from osvl.synth.pipeline import CurationConfig, curate
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
