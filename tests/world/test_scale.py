"""``--scale``: the same world recipe with more entities; the country hubs stay few."""

from __future__ import annotations

import json

import pytest

from osvl.world.__main__ import main
from osvl.world.generate import WorldConfig


def test_scaled_multiplies_entity_counts_but_not_the_hubs():
    base, triple = WorldConfig(seed=4), WorldConfig(seed=4).scaled(3)
    for name in ("cities", "persons", "buildings", "organisms", "artifacts"):
        assert getattr(triple, name) == 3 * getattr(base, name)
    assert triple.countries == base.countries and triple.seed == 4
    with pytest.raises(ValueError, match="world scale must be >= 1"):
        base.scaled(0)


def test_cli_scale(tmp_path, capsys):
    assert main(["build", "--out", str(tmp_path / "w2"), "--seed", "1", "--scale", "2"]) == 0
    two = json.loads(capsys.readouterr().out)["entities"]
    assert main(["build", "--out", str(tmp_path / "w1"), "--seed", "1"]) == 0
    one = json.loads(capsys.readouterr().out)["entities"]
    assert two > 1.8 * one
    with pytest.raises(SystemExit):
        main(["build", "--out", str(tmp_path / "w0"), "--scale", "0"])
