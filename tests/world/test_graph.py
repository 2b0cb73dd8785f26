"""The JSONL hyperlink-graph format, its streaming reader and the Wikipedia-extract converter."""

from __future__ import annotations

import json

import pytest

from osvl.world.graph import (
    Graph,
    Link,
    Page,
    iter_pages,
    namespace_of,
    page_id,
    write_pages,
)
from osvl.world.wikipedia import convert_wikiextractor, parse_links


def test_pages_round_trip_through_jsonl(tmp_path):
    pages = [
        Page(id="A", title="A", domain="Person", infobox={"born": "1900"}, links=[Link("B_redirect", "spouse", "Bee")]),
        Page(id="B", title="B", domain="Person", aliases=["Bee"]),
        Page(id="B_redirect", title="B redirect", redirect="B"),
    ]
    path = tmp_path / "graph.jsonl"
    assert write_pages(path, pages) == 3
    loaded = Graph.load(path)
    assert [loaded[p.id].to_dict() for p in pages] == [p.to_dict() for p in pages]
    assert loaded.resolve("B_redirect") == "B" and loaded.edges("A", "spouse") == ["B"]
    assert loaded.surface_forms("B") == ["B", "Bee", "B redirect"]
    assert loaded.resolve("missing") is None


def test_redirect_loops_resolve_to_none():
    graph = Graph({"X": Page(id="X", title="X", redirect="Y"), "Y": Page(id="Y", title="Y", redirect="X")})
    assert graph.resolve("X") is None


def test_reader_reports_bad_lines_with_their_number(tmp_path):
    path = tmp_path / "graph.jsonl"
    path.write_text(json.dumps({"id": "A", "title": "A"}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"graph.jsonl:2: not JSON"):
        list(iter_pages(path))
    path.write_text(json.dumps({"title": "A"}) + "\n")
    with pytest.raises(ValueError, match=r":1: graph record lacks required field 'id'"):
        list(iter_pages(path))
    path.write_text(json.dumps({"id": "A", "title": "A", "domain": "Planet"}) + "\n")
    with pytest.raises(ValueError, match="unknown domain"):
        list(iter_pages(path))
    path.write_text((json.dumps({"id": "A", "title": "A"}) + "\n") * 2)
    with pytest.raises(ValueError, match="duplicate page id"):
        Graph.load(path)
    with pytest.raises(ValueError, match="no page"):
        Graph({})["nope"]


def test_namespaces_and_ids():
    assert namespace_of("Category:Zoos") == "Category" and namespace_of("File:x.png") == "File"
    assert namespace_of("Star Wars: A New Hope") == "" and page_id(" Australia  Zoo ") == "Australia_Zoo"


def test_parse_links_strips_markup():
    text, links = parse_links(
        'Run by <a href="Steve%20Irwin">the Crocodile Hunter</a> in <a href="queensland#History">Queensland</a>.'
    )
    assert text == "Run by the Crocodile Hunter in Queensland."
    assert links == [
        Link("Steve_Irwin", "the Crocodile Hunter", "the Crocodile Hunter"),
        Link("Queensland", "Queensland", "Queensland"),
    ]


def test_convert_wikiextractor(tmp_path):
    extract = tmp_path / "wiki_00"
    docs = [
        {
            "id": "1",
            "url": "u1",
            "title": "Australia Zoo",
            "text": 'A zoo run by <a href="Crocodile%20Hunter">Steve</a> near <a href="Beerwah">Beerwah</a>.',
        },
        {"id": "2", "url": "u2", "title": "Steve Irwin", "text": 'Married <a href="Terri%20Irwin">Terri</a>.'},
        {"id": "3", "url": "u3", "title": "Terri Irwin", "text": "Naturalist."},
        {
            "id": "4",
            "url": "u4",
            "title": "Irwin (disambiguation)",
            "text": '<a href="Steve%20Irwin">Steve</a>, <a href="Terri%20Irwin">Terri</a>',
        },
        {"id": "5", "url": "u5", "title": "Category:Zoos", "text": '<a href="Australia%20Zoo">AZ</a>'},
    ]
    extract.write_text("".join(json.dumps(d) + "\n" for d in docs))
    redirects = tmp_path / "redirects.tsv"
    redirects.write_text("Crocodile Hunter\tSteve Irwin\n")
    side = tmp_path / "side.jsonl"
    side.write_text(
        json.dumps(
            {
                "title": "Terri Irwin",
                "domain": "Person",
                "kind": "person",
                "infobox": {"citizenship date": "17 November 2009"},
                "images": [{"file": "t.png", "width": 800, "height": 600}],
            }
        )
        + "\n"
    )
    counts = convert_wikiextractor([extract], tmp_path / "out", redirects, side)
    assert counts == {"pages": 6, "redirects": 1, "links": 6, "dangling_links": 1}
    graph = Graph.load(tmp_path / "out" / "graph.jsonl")
    assert graph.edges("Australia_Zoo") == ["Steve_Irwin"]  # Beerwah dangles
    assert graph["Irwin_(disambiguation)"].disambiguation and graph["Category:Zoos"].namespace == "Category"
    # in-degree: Steve via the redirect + disambiguation page; the category page does not count
    assert graph["Steve_Irwin"].in_degree == 2 and graph["Australia_Zoo"].in_degree == 0
    terri = graph["Terri_Irwin"]
    assert terri.infobox == {"citizenship date": "17 November 2009"} and terri.images[0].width == 800
    corpus = [json.loads(line) for line in (tmp_path / "out" / "corpus.jsonl").read_text().splitlines()]
    assert corpus[0]["text"] == "A zoo run by Steve near Beerwah." and len(corpus) == 5


def test_convert_rejects_bad_inputs(tmp_path):
    extract = tmp_path / "wiki_00"
    extract.write_text(json.dumps({"id": "1"}) + "\n")
    with pytest.raises(ValueError, match="wiki_00:1: not a WikiExtractor JSON article"):
        convert_wikiextractor([extract], tmp_path / "out")
    extract.write_text(json.dumps({"title": "A", "text": "x"}) + "\n")
    bad = tmp_path / "r.tsv"
    bad.write_text("only-one-column\n")
    with pytest.raises(ValueError, match="r.tsv:1: expected 'source<TAB>target'"):
        convert_wikiextractor([extract], tmp_path / "out", bad)
