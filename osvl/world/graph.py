"""The hyperlink graph: one JSON object per page in ``graph.jsonl``.

This is the input of path sampling (App. D.1) for the mini-world and for real Wikipedia alike.
A line holds the page's structure only, never its text (text lives in ``corpus.jsonl``), so the
graph fits in memory in proportion to pages + links. Fields of a line:

- ``id``: page id, the title with spaces as underscores (``Australia_Zoo``)
- ``title``: display title; ``namespace``: ``""`` for articles, else ``Category``/``File``/...
- ``redirect``: target page id for a redirect page, else null
- ``disambiguation``: true for disambiguation pages
- ``domain``: Person | Building/Place | Location | Organism | Artifact, or null
- ``kind``: the noun a descriptor uses for the entity ("person", "zoo", "beetle"), or null
- ``aliases``: other surface forms of the entity (leak checks use them)
- ``infobox``: attribute name -> string value
- ``links``: ``[{"target": page id, "relation": label, "anchor": anchor text}]`` in page order;
  ``relation`` is the typed relation (mini-world) or the anchor text (Wikipedia extracts)
- ``images``: ``[{"file": path relative to the graph file, "width", "height", "caption",
  "facts": [[relation, page id], ...] that the caption states}]``
- ``in_degree``: distinct article pages linking here, redirects dereferenced
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from osvl.jsonl import iter_records, write_jsonl

DOMAINS = ("Person", "Building/Place", "Location", "Organism", "Artifact")
NON_ARTICLE_NAMESPACES = ("Template", "Category", "File", "User", "Help", "Portal", "Wikipedia")


@dataclass(frozen=True)
class Link:
    target: str
    relation: str
    anchor: str = ""


@dataclass(frozen=True)
class ImageRef:
    file: str
    width: int
    height: int
    caption: str = ""
    facts: list[list[str]] = field(default_factory=list)  # [relation, page id] pairs the caption states


@dataclass
class Page:
    id: str
    title: str
    namespace: str = ""
    redirect: str | None = None
    disambiguation: bool = False
    domain: str | None = None
    kind: str | None = None
    aliases: list[str] = field(default_factory=list)
    infobox: dict[str, str] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)
    in_degree: int = 0

    def __post_init__(self) -> None:
        if not self.id or not isinstance(self.id, str):
            raise ValueError(f"page id must be a non-empty string, got {self.id!r}")
        if self.domain is not None and self.domain not in DOMAINS:
            raise ValueError(f"page {self.id!r}: unknown domain {self.domain!r}; expected one of {DOMAINS}")
        if self.in_degree < 0:
            raise ValueError(f"page {self.id!r}: in_degree must be >= 0, got {self.in_degree}")

    @property
    def is_article(self) -> bool:
        return self.namespace == "" and self.redirect is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Page:
        try:
            return cls(
                id=data["id"],
                title=data["title"],
                namespace=data.get("namespace", ""),
                redirect=data.get("redirect"),
                disambiguation=bool(data.get("disambiguation", False)),
                domain=data.get("domain"),
                kind=data.get("kind"),
                aliases=list(data.get("aliases", [])),
                infobox={str(k): str(v) for k, v in data.get("infobox", {}).items()},
                links=[Link(**link) for link in data.get("links", [])],
                images=[ImageRef(**image) for image in data.get("images", [])],
                in_degree=int(data.get("in_degree", 0)),
            )
        except KeyError as missing:
            raise ValueError(f"graph record lacks required field {missing}: {str(data)[:200]}") from None
        except TypeError as bad:
            raise ValueError(f"malformed graph record ({bad}): {str(data)[:200]}") from None


def namespace_of(title: str) -> str:
    """``Category:Zoos`` -> ``Category``; article titles have the empty namespace."""
    head, sep, _ = title.partition(":")
    return head if sep and head in NON_ARTICLE_NAMESPACES else ""


def page_id(title: str) -> str:
    return "_".join(title.strip().split())


def iter_pages(path: str | os.PathLike[str]) -> Iterator[Page]:
    """Stream pages from a ``graph.jsonl``; a malformed line names its line number."""
    return iter_records(path, Page.from_dict)


def write_pages(path: str | os.PathLike[str], pages: Iterable[Page]) -> int:
    """Write pages as JSONL with sorted keys (byte-stable for a given page list)."""
    return write_jsonl(path, (page.to_dict() for page in pages))


def compute_in_degrees(pages: dict[str, Page]) -> dict[str, int]:
    """Distinct article sources per dereferenced target; self-links do not count."""
    graph = Graph(pages)
    sources: dict[str, set[str]] = {}
    for page in pages.values():
        if not page.is_article:
            continue
        for link in page.links:
            target = graph.resolve(link.target)
            if target is not None and target != page.id:
                sources.setdefault(target, set()).add(page.id)
    return {pid: len(sources.get(pid, ())) for pid in pages}


class Graph:
    """Pages by id, with redirect dereferencing and typed edges over articles."""

    def __init__(self, pages: dict[str, Page]) -> None:
        self.pages = pages
        self._redirects_in: dict[str, list[str]] | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Graph:
        pages: dict[str, Page] = {}
        for page in iter_pages(path):
            if page.id in pages:
                raise ValueError(f"{path}: duplicate page id {page.id!r}")
            pages[page.id] = page
        return cls(pages)

    def __contains__(self, pid: str) -> bool:
        return pid in self.pages

    def __getitem__(self, pid: str) -> Page:
        try:
            return self.pages[pid]
        except KeyError:
            raise ValueError(f"no page {pid!r} in the graph") from None

    def resolve(self, pid: str, max_hops: int = 8) -> str | None:
        """Follow redirects to an existing page; None for dangling links or redirect loops."""
        seen = 0
        while pid in self.pages and self.pages[pid].redirect is not None:
            pid = self.pages[pid].redirect  # type: ignore[assignment]
            seen += 1
            if seen > max_hops:
                return None
        return pid if pid in self.pages else None

    def entities(self) -> Iterator[Page]:
        """Articles that are entities (typed by a domain)."""
        return (p for p in self.pages.values() if p.is_article and p.domain is not None)

    def edges(self, source: str, relation: str | None = None) -> list[str]:
        """Dereferenced article targets of ``source``'s links, optionally of one relation."""
        targets = []
        for link in self[source].links:
            if relation is not None and link.relation != relation:
                continue
            target = self.resolve(link.target)
            if target is not None:
                targets.append(target)
        return targets

    def surface_forms(self, pid: str) -> list[str]:
        """Title, aliases and the titles of redirects pointing here: everything a leak check bans."""
        if self._redirects_in is None:
            self._redirects_in = {}
            for page in self.pages.values():
                if page.redirect is not None:
                    self._redirects_in.setdefault(page.redirect, []).append(page.title)
        page = self[pid]
        return [page.title, *page.aliases, *self._redirects_in.get(pid, [])]
