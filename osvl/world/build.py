"""Write a generated world to disk and load it back (layout in ``osvl/world/README.md``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

from osvl.jsonl import iter_jsonl, write_jsonl
from osvl.world.generate import WorldConfig, generate_pages
from osvl.world.graph import Graph, Page, write_pages
from osvl.world.render import render_entity, stable_seed

FORMAT_VERSION = 1


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling thresholds scaled to the mini-world (the paper's are for all of Wikipedia)."""

    hub_threshold: int = 40  # paper: 10,000
    min_seed_in_degree: int = 3  # paper: 50
    min_image_side: int = 512  # paper: 512


def page_text(page: Page, graph: Graph, incoming: dict[str, list[tuple[str, str]]]) -> str:
    """Plain encyclopedic prose for one article: lead, infobox facts, relations both ways."""
    if page.disambiguation:
        return f"{page.title} may refer to: " + "; ".join(graph[link.target].title for link in page.links) + "."
    if page.domain is None:
        return (
            f"{page.title}: "
            + ", ".join(graph[link.target].title for link in page.links if graph.resolve(link.target))
            + "."
        )
    sentences = [f"{page.title} is a {page.kind}."]
    if page.aliases:
        sentences.append(f"It is also known as {', '.join(page.aliases)}.")
    sentences += [f"Its {key} is {value}." for key, value in page.infobox.items()]
    for link in page.links:
        target = graph.resolve(link.target)
        if target is not None and graph[target].is_article and graph[target].domain is not None:
            sentences.append(f"The {link.relation} of {page.title} is {graph[target].title}.")
    for relation, source in incoming.get(page.id, []):
        sentences.append(f"{page.title} is the {relation} of {graph[source].title}.")
    return " ".join(sentences)


def _incoming(graph: Graph) -> dict[str, list[tuple[str, str]]]:
    incoming: dict[str, list[tuple[str, str]]] = {}
    for page in graph.entities():
        for link in page.links:
            target = graph.resolve(link.target)
            if target is not None and graph[target].domain is not None:
                incoming.setdefault(target, []).append((link.relation, page.id))
    return incoming


def _write_png(path: Path, image: np.ndarray) -> None:
    ok, png = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 3])
    if not ok:
        raise ValueError(f"PNG encoding failed for {path}")
    path.write_bytes(png.tobytes())


def build_world(out: str | os.PathLike[str], config: WorldConfig | None = None) -> dict:
    """Generate the world into ``out`` (created; existing world files are overwritten); returns the manifest."""
    config = config or WorldConfig()
    root = Path(out)
    (root / "images").mkdir(parents=True, exist_ok=True)
    pages = generate_pages(config)
    graph = Graph({p.id: p for p in pages})
    write_pages(root / "graph.jsonl", pages)
    incoming = _incoming(graph)
    corpus = [
        {
            "id": p.id,
            "title": p.title,
            "text": page_text(p, graph, incoming),
            "url": f"world://{p.id}",
            "aliases": p.aliases,
        }
        for p in pages
        if p.is_article
    ]
    write_jsonl(root / "corpus.jsonl", corpus)
    collection = []
    for page in pages:
        for ref in page.images:
            image = render_entity(page.title, page.domain or "Artifact", ref.width, stable_seed(config.seed, page.id))
            _write_png(root / ref.file, image)
            collection.append(
                {
                    "image": ref.file,
                    "title": page.title,
                    "caption": ref.caption,
                    "page_id": page.id,
                    "width": ref.width,
                    "height": ref.height,
                    "facts": ref.facts,
                }
            )
    write_jsonl(root / "images.jsonl", collection)
    manifest = {
        "format": FORMAT_VERSION,
        "config": asdict(config),
        "sampling": asdict(SamplingDefaults()),
        "files": {"graph": "graph.jsonl", "corpus": "corpus.jsonl", "images": "images.jsonl"},
        "counts": {
            "pages": len(pages),
            "entities": sum(1 for _ in graph.entities()),
            "corpus": len(corpus),
            "images": len(collection),
        },
    }
    (root / "world.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


@dataclass(frozen=True)
class ImageRecord:
    image: Path  # absolute path of the PNG
    title: str
    caption: str
    page_id: str
    width: int
    height: int
    facts: list[list[str]]


@dataclass
class World:
    """A built world on disk: its graph in memory, corpus and collection by path."""

    root: Path
    graph: Graph
    sampling: SamplingDefaults
    corpus_path: Path
    images_path: Path

    def corpus(self) -> Iterator[dict]:
        for _, record in iter_jsonl(self.corpus_path):
            yield record

    def images(self) -> Iterator[ImageRecord]:
        for _, data in iter_jsonl(self.images_path):
            yield ImageRecord(
                image=self.root / data["image"],
                title=data["title"],
                caption=data["caption"],
                page_id=data["page_id"],
                width=data["width"],
                height=data["height"],
                facts=data.get("facts", []),
            )

    def load_image(self, page_id: str) -> np.ndarray:
        """The entity's first image as RGB uint8."""
        refs = self.graph[page_id].images
        if not refs:
            raise ValueError(f"page {page_id!r} has no image")
        data = cv2.imread(str(self.root / refs[0].file), cv2.IMREAD_COLOR)
        if data is None:
            raise ValueError(f"cannot read image {self.root / refs[0].file}")
        return cv2.cvtColor(data, cv2.COLOR_BGR2RGB)


def load_world(path: str | os.PathLike[str]) -> World:
    """Open a world directory written by :func:`build_world` (or laid out the same way)."""
    root = Path(path)
    manifest_path = root / "world.json"
    if not manifest_path.is_file():
        raise ValueError(
            f"{root} is not a world directory: no world.json (build one with `python -m osvl.world build --out {root}`)"
        )
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{manifest_path}: unsupported world format {manifest.get('format')!r}; expected {FORMAT_VERSION}"
        )
    files = manifest["files"]
    return World(
        root=root,
        graph=Graph.load(root / files["graph"]),
        sampling=SamplingDefaults(**manifest.get("sampling", {})),
        corpus_path=root / files["corpus"],
        images_path=root / files["images"],
    )


def graph_world(
    graph_path: str | os.PathLike[str],
    images_dir: str | os.PathLike[str],
    collection_path: str | os.PathLike[str],
    corpus_path: str | os.PathLike[str] | None = None,
    sampling: SamplingDefaults | None = None,
) -> World:
    """A world over a converted graph (e.g. ``osvl.world.wikipedia`` output) rather than a built
    directory: image files are relative to ``images_dir``; the image collection is derived from
    the pages' image references and written to ``collection_path`` (absolute image paths, so
    the ImageSearch index can sit anywhere); the corpus defaults to ``corpus.jsonl`` beside the
    graph. The sampling thresholds default to the paper's (all of Wikipedia)."""
    graph_path, images_dir = Path(graph_path), Path(images_dir)
    corpus = Path(corpus_path) if corpus_path is not None else graph_path.parent / "corpus.jsonl"
    for path, what in ((graph_path, "graph file"), (corpus, "corpus file")):
        if not path.is_file():
            raise ValueError(f"{what} {path} does not exist")
    if not images_dir.is_dir():
        raise ValueError(f"images directory {images_dir} does not exist")
    graph = Graph.load(graph_path)
    collection = [
        {
            "image": str(images_dir.resolve() / ref.file),
            "title": page.title,
            "caption": ref.caption,
            "page_id": page.id,
            "width": ref.width,
            "height": ref.height,
            "facts": ref.facts,
        }
        for page in graph.pages.values()
        for ref in page.images
    ]
    Path(collection_path).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(collection_path, collection)
    return World(
        root=images_dir.resolve(),
        graph=graph,
        sampling=sampling or SamplingDefaults(10_000, 50, 512),
        corpus_path=corpus,
        images_path=Path(collection_path),
    )
