"""A world over a converted graph (real Wikipedia) instead of a built world directory."""

from __future__ import annotations

import json

import pytest

from osvl.world import graph_world


def test_graph_world_derives_the_image_collection(world, tmp_path):
    opened = graph_world(world.root / "graph.jsonl", world.root, tmp_path / "collection.jsonl")
    assert opened.corpus_path == world.root / "corpus.jsonl" and opened.root == world.root.resolve()
    assert (opened.sampling.hub_threshold, opened.sampling.min_seed_in_degree) == (10_000, 50)
    derived = {(r.page_id, r.image, r.caption) for r in opened.images()}
    assert derived == {(r.page_id, r.image.resolve(), r.caption) for r in world.images()}
    rows = [json.loads(line) for line in (tmp_path / "collection.jsonl").open()]
    assert all(row["image"].startswith(str(world.root.resolve())) for row in rows)


def test_graph_world_rejects_missing_inputs(world, tmp_path):
    with pytest.raises(ValueError, match="graph file .* does not exist"):
        graph_world(tmp_path / "graph.jsonl", world.root, tmp_path / "c.jsonl")
    with pytest.raises(ValueError, match="corpus file .* does not exist"):
        graph_world(world.root / "graph.jsonl", world.root, tmp_path / "c.jsonl", tmp_path / "corpus.jsonl")
    with pytest.raises(ValueError, match="images directory .* does not exist"):
        graph_world(world.root / "graph.jsonl", tmp_path / "nope", tmp_path / "c.jsonl")
    assert not (tmp_path / "c.jsonl").exists()
