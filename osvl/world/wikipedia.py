"""Convert a Wikipedia dump extract into the graph + corpus layout of a world directory.

Inputs (all line-oriented, streamed):

- WikiExtractor JSON run with ``--json --links``: one ``{"id", "url", "title", "text"}`` object per
  article, links kept in the text as ``<a href="Steve%20Irwin">Steve Irwin</a>``;
- optional redirects TSV, ``source title<TAB>target title`` per line (from the ``redirect`` and
  ``page`` SQL tables), since WikiExtractor drops redirect pages;
- optional side JSONL, one ``{"title", "infobox", "domain", "kind", "aliases", "images"}`` object per
  page (infobox attributes and Commons image references, e.g. from a wikitext template parser).

Page text goes straight to ``corpus.jsonl``; only ids, links and side data stay in memory, so the
memory is proportional to the graph. A link's relation is its anchor text (Sec. 3.1).
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote

from osvl.jsonl import iter_jsonl
from osvl.world.graph import (
    Graph,
    ImageRef,
    Link,
    Page,
    compute_in_degrees,
    namespace_of,
    page_id,
    write_pages,
)

_ANCHOR = re.compile(r'<a href="([^"]*)">(.*?)</a>', re.DOTALL)
_TAG = re.compile(r"<[^>]+>")


def parse_links(text: str) -> tuple[str, list[Link]]:
    """Plain text and the links of one WikiExtractor ``--links`` article body."""
    links = []
    for match in _ANCHOR.finditer(text):
        target = unquote(html.unescape(match.group(1))).split("#", 1)[0]
        anchor = html.unescape(_TAG.sub("", match.group(2))).strip()
        if target:
            target = target[0].upper() + target[1:]  # MediaWiki titles are first-letter case-insensitive
            links.append(Link(target=page_id(target), relation=anchor or target, anchor=anchor))
    plain = html.unescape(_TAG.sub("", _ANCHOR.sub(lambda m: m.group(2), text)))
    return plain, links


def _read_side(path: str | os.PathLike[str] | None) -> dict[str, dict]:
    side: dict[str, dict] = {}
    if path is None:
        return side
    for number, data in iter_jsonl(path):
        if "title" not in data:
            raise ValueError(f"{path}:{number}: side record lacks 'title'")
        side[page_id(data["title"])] = data
    return side


def convert_wikiextractor(
    extracts: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    redirects_tsv: str | os.PathLike[str] | None = None,
    side_jsonl: str | os.PathLike[str] | None = None,
) -> dict[str, int]:
    """Write ``graph.jsonl`` and ``corpus.jsonl`` under ``out``; returns counts."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    side = _read_side(side_jsonl)
    pages: dict[str, Page] = {}
    with open(root / "corpus.jsonl", "w", encoding="utf-8", newline="\n") as corpus:
        for extract in extracts:
            for number, doc in iter_jsonl(extract):
                try:
                    title = doc["title"]
                    raw = doc["text"]
                except (KeyError, TypeError):
                    raise ValueError(
                        f"{extract}:{number}: not a WikiExtractor JSON article (needs 'title' and 'text')"
                    ) from None
                text, links = parse_links(raw)
                pid = page_id(title)
                extra = side.get(pid, {})
                pages[pid] = Page(
                    id=pid,
                    title=title,
                    namespace=namespace_of(title),
                    disambiguation="(disambiguation)" in title,
                    domain=extra.get("domain"),
                    kind=extra.get("kind"),
                    aliases=list(extra.get("aliases", [])),
                    infobox={str(k): str(v) for k, v in extra.get("infobox", {}).items()},
                    links=links,
                    images=[ImageRef(**image) for image in extra.get("images", [])],
                )
                corpus.write(
                    json.dumps(
                        {
                            "id": pid,
                            "title": title,
                            "text": text,
                            "url": doc.get("url", ""),
                            "aliases": pages[pid].aliases,
                        },
                        ensure_ascii=False,
                    )
                    + "\n"
                )
    redirects = 0
    if redirects_tsv is not None:
        with open(redirects_tsv, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 2 or not all(parts):
                    raise ValueError(f"{redirects_tsv}:{number}: expected 'source<TAB>target'")
                source, target = (page_id(p) for p in parts)
                if source not in pages:
                    pages[source] = Page(id=source, title=parts[0], namespace=namespace_of(parts[0]), redirect=target)
                    redirects += 1
    for pid, degree in compute_in_degrees(pages).items():
        pages[pid].in_degree = degree
    write_pages(root / "graph.jsonl", pages.values())
    graph = Graph(pages)
    return {
        "pages": len(pages),
        "redirects": redirects,
        "links": sum(len(p.links) for p in pages.values()),
        "dangling_links": sum(graph.resolve(link.target) is None for p in pages.values() for link in p.links),
    }
