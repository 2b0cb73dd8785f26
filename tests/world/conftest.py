"""One default mini-world per test session, built through the CLI entry point."""

from __future__ import annotations

import pytest

from osvl.world import load_world
from osvl.world.__main__ import main


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    assert main(["build", "--out", str(root), "--seed", "0"]) == 0
    return load_world(root)
