"""Anchor grounding (Sec. 3.1) and the degradation subset (Sec. 3.2).

Grounding picks the best image of v0 under a pluggable image-text scorer (CLIP online; metadata
overlap offline), replaces v0's mention by a visual referring expression, and re-checks masking
over every node of the path. Degradation damages 10% of items in a way one tool repairs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import cv2
import numpy as np

from osvl.rl.offline_judges import normalize_answer
from osvl.synth.question import Mention, leaked_forms, render_question
from osvl.synth.records import Drop, QAItem
from osvl.world.build import ImageRecord
from osvl.world.graph import Graph
from osvl.world.render import stable_seed

REPAIR_TOOL = {"blur": "sharpen", "downsample": "super_resolution", "perspective": "perspective_correct"}


class ImageTextScorer(Protocol):
    def score(self, image: ImageRecord, description: str) -> float: ...


class MetadataScorer:
    """Offline stand-in for CLIP: share of description words found in the image's title and caption."""

    def score(self, image: ImageRecord, description: str) -> float:
        wanted = set(normalize_answer(description).split())
        have = set(normalize_answer(f"{image.title} {image.caption}").split())
        return len(wanted & have) / len(wanted) if wanted else 0.0


@dataclass
class AnchorGrounder:
    graph: Graph
    images_by_page: dict[str, list[ImageRecord]]
    root: Path  # image paths in items are stored relative to this directory
    scorer: ImageTextScorer
    min_score: float = 0.5
    min_side: int = 512

    @classmethod
    def for_collection(
        cls, graph: Graph, images: Iterable[ImageRecord], root: Path, scorer: ImageTextScorer, **kwargs
    ) -> AnchorGrounder:
        by_page: dict[str, list[ImageRecord]] = {}
        for record in images:
            by_page.setdefault(record.page_id, []).append(record)
        return cls(graph, by_page, root, scorer, **kwargs)

    def __call__(self, item: QAItem) -> QAItem | Drop:
        anchor = self.graph[item.path[0]]
        description = f"{anchor.title} {anchor.kind or ''}".strip()
        candidates = [r for r in self.images_by_page.get(anchor.id, []) if min(r.width, r.height) >= self.min_side]
        if not candidates:
            return Drop("no_anchor_image")
        best = max(candidates, key=lambda r: (self.scorer.score(r, description), -len(str(r.image))))
        score = self.scorer.score(best, description)
        if score < self.min_score:
            return Drop("low_visual_relevance")
        question = item.question.with_mention(0, Mention(noun=anchor.kind, visual=True))
        forms = [f for node in item.path for f in self.graph.surface_forms(node)]
        if leaked_forms(render_question(question), forms):
            return Drop("masking_leak")
        return replace(
            item, question=question, image=str(best.image.relative_to(self.root)), grounding_score=round(score, 4)
        )


def degrade(image: np.ndarray, kind: str, rng: random.Random) -> np.ndarray:
    """Blur, 4x downsample, or a perspective warp onto a plain backdrop (so a quad can be found)."""
    if kind == "blur":
        return cv2.GaussianBlur(image, (0, 0), sigmaX=rng.uniform(2.5, 4.0))
    if kind == "downsample":
        height, width = image.shape[:2]
        return cv2.resize(image, (max(1, width // 4), max(1, height // 4)), interpolation=cv2.INTER_AREA)
    if kind == "perspective":
        height, width = image.shape[:2]
        pad = int(0.25 * max(height, width))
        canvas_w, canvas_h = width + 2 * pad, height + 2 * pad

        def jitter():
            return rng.uniform(0.0, 0.6) * pad

        target = np.float32(
            [
                [pad - jitter(), pad - jitter()],
                [pad + width + jitter(), pad + jitter()],
                [pad + width - jitter(), pad + height + jitter()],
                [pad + jitter(), pad + height - jitter()],
            ]
        )
        source = np.float32([[0, 0], [width, 0], [width, height], [0, height]])
        matrix = cv2.getPerspectiveTransform(source, target)
        return cv2.warpPerspective(
            image,
            matrix,
            (canvas_w, canvas_h),
            flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_CONSTANT,
            borderValue=(235, 235, 235),
        )
    raise ValueError(f"unknown degradation {kind!r}; expected one of {sorted(REPAIR_TOOL)}")


def in_degradation_subset(item_id: str, fraction: float, seed: int) -> bool:
    """A stable per-item coin, so the subset does not depend on order or resumption."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"degradation fraction must lie in [0, 1], got {fraction}")
    return (stable_seed(seed, "degrade", item_id) % 1_000_000) / 1_000_000 < fraction


@dataclass
class Degrader:
    """Stage: degrade the selected items' images into ``out_dir`` and record the repairing tool."""

    root: Path  # the world root: item image paths are relative to it
    base: Path  # the curation output directory: degraded images go to ``base/degraded``
    load: Callable[[Path], np.ndarray]
    fraction: float = 0.1
    seed: int = 0

    def __call__(self, item: QAItem) -> QAItem:
        if item.image is None or not in_degradation_subset(item.id, self.fraction, self.seed):
            return item
        rng = random.Random(stable_seed(self.seed, "kind", item.id))
        kind = rng.choice(sorted(REPAIR_TOOL))
        damaged = degrade(self.load(self.root / item.image), kind, rng)
        target = self.base / "degraded" / f"{item.id}.{kind}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        ok, png = cv2.imencode(".png", cv2.cvtColor(damaged, cv2.COLOR_RGB2BGR))
        if not ok:
            raise ValueError(f"PNG encoding failed for {target}")
        target.write_bytes(png.tobytes())
        return replace(
            item,
            degradation={"kind": kind, "repair_tool": REPAIR_TOOL[kind], "image": str(target.relative_to(self.base))},
        )
