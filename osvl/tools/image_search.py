"""ImageSearch: which known entity does this picture show? Offline or online.

Offline: a near-duplicate index over a local collection (JSONL of ``image`` path, ``title``,
``caption``, ``page_id``), queried by a cascade from cheap and strict to costly and lenient:
perceptual hash (survives resizing, blur, re-encoding) -> ORB features with a RANSAC homography
(survives crops and small rotations) -> colour histogram (a weak hint, labelled as such).
Online: a reverse-image HTTP API; the image is first uploaded to ``upload_url`` when one is
configured so the API receives a URL, otherwise it is sent inline as base64.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from osvl.jsonl import iter_jsonl
from osvl.tools.config import HttpConfig, ImageSearchConfig, ToolBackendsConfig
from osvl.tools.errors import BackendError, ToolError
from osvl.tools.http_client import request_json
from osvl.tools.image_io import encode_png, read_image
from osvl.tools.registry import ToolOutput

PHASH_MAX_DISTANCE = 12  # of 64 bits
ORB_MIN_INLIERS = 15
HISTOGRAM_MIN_CORRELATION = 0.6
FEATURE_SIDE = 512  # images are resized to this longer side for ORB
ORB_FEATURES = 1000
ORB_MIN_SIDE = 64  # ORB's 31-pixel patches and 8-level pyramid find nothing (or assert) on thinner images


@dataclass
class Entry:
    title: str
    caption: str
    page_id: str
    phash: np.ndarray  # (1, 8) uint8
    keypoints: np.ndarray  # (N, 2) float32
    descriptors: np.ndarray | None  # (N, 32) uint8
    histogram: np.ndarray


@dataclass
class Match:
    title: str
    caption: str
    page_id: str
    kind: str  # near_duplicate | feature_match | similar_colours
    score: float


def _phash(image: np.ndarray) -> np.ndarray:
    return cv2.img_hash.pHash(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY))


def _orb(image: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Keypoints and descriptors; none for an image too thin to hold a feature (a policy may crop 1x2000)."""
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    scale = FEATURE_SIDE / max(gray.shape)
    if scale < 1:
        size = (max(1, round(gray.shape[1] * scale)), max(1, round(gray.shape[0] * scale)))
        gray = cv2.resize(gray, size, interpolation=cv2.INTER_AREA)
    if min(gray.shape) < ORB_MIN_SIDE:
        return np.zeros((0, 2), np.float32), None
    keypoints, descriptors = cv2.ORB_create(nfeatures=ORB_FEATURES).detectAndCompute(gray, None)
    return np.array([k.pt for k in keypoints], dtype=np.float32).reshape(-1, 2), descriptors


def _histogram(image: np.ndarray) -> np.ndarray:
    hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)
    hist = cv2.calcHist([hsv], [0, 1], None, [30, 32], [0, 180, 0, 256])
    return cv2.normalize(hist, hist).flatten()


def describe(image: np.ndarray, title: str = "", caption: str = "", page_id: str = "") -> Entry:
    keypoints, descriptors = _orb(image)
    return Entry(title, caption, page_id, _phash(image), keypoints, descriptors, _histogram(image))


def _inliers(query: Entry, entry: Entry) -> int:
    if (
        query.descriptors is None
        or entry.descriptors is None
        or len(query.descriptors) < 4
        or len(entry.descriptors) < 4
    ):
        return 0
    pairs = cv2.BFMatcher(cv2.NORM_HAMMING).knnMatch(query.descriptors, entry.descriptors, k=2)
    good = [p[0] for p in pairs if len(p) == 2 and p[0].distance < 0.75 * p[1].distance]
    if len(good) < ORB_MIN_INLIERS:
        return 0
    source = query.keypoints[[m.queryIdx for m in good]]
    target = entry.keypoints[[m.trainIdx for m in good]]
    _, mask = cv2.findHomography(source, target, cv2.RANSAC, 5.0)
    return 0 if mask is None else int(mask.sum())


class NearDuplicateIndex:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], max_pixels: int) -> NearDuplicateIndex:
        """The collection's index; its features come from the cache file beside the collection when that
        was made from the same collection, image files, size limit and feature settings (describing the
        demo world's 720 images costs a tool worker ~4.3 s of CPU, reading the cache ~0.03 s), else are
        computed and the cache (re)written; a cache that cannot be read or written is ignored."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"image collection {path} does not exist")
        records = []
        for number, record in iter_jsonl(path):
            if (
                not isinstance(record, dict)
                or not isinstance(record.get("image"), str)
                or not isinstance(record.get("title"), str)
            ):
                raise ValueError(f"{path}:{number}: needs string fields 'image' and 'title'")
            records.append((number, record))
        names = [(r["title"], str(r.get("caption", "")), str(r.get("page_id", ""))) for _, r in records]
        key = _cache_key(path, records, max_pixels)
        cache = _cache_path(path)
        entries = _read_entries(cache, key, names)
        if entries is None:
            entries = []
            for (number, record), name in zip(records, names):
                try:
                    image = read_image(path.parent / record["image"], max_pixels)
                except (OSError, ValueError) as err:
                    raise ValueError(f"{path}:{number}: {err}") from None
                entries.append(describe(image, *name))
            _write_entries(cache, key, entries)
        return cls(entries)

    def search(self, image: np.ndarray, top_k: int) -> list[Match]:
        query = describe(image)
        distances = [int(cv2.norm(query.phash, e.phash, cv2.NORM_HAMMING)) for e in self.entries]
        found: dict[int, Match] = {}
        for i in sorted(range(len(self.entries)), key=distances.__getitem__):
            if distances[i] <= PHASH_MAX_DISTANCE:
                found[i] = self._match(i, "near_duplicate", 1 - distances[i] / 64)
        # A cascade: each stage runs only when the cheaper one found nothing. Near-duplicates are
        # what a reverse-image search is for; running ORB + RANSAC against the whole collection
        # just to pad top_k cost seconds per call on the mini-world.
        if not found:
            inliers = {i: _inliers(query, e) for i, e in enumerate(self.entries)}
            for i in sorted(inliers, key=lambda i: -inliers[i]):
                if inliers[i] >= ORB_MIN_INLIERS:
                    found[i] = self._match(i, "feature_match", float(inliers[i]))
        if not found:
            correlations = {
                i: float(cv2.compareHist(query.histogram, e.histogram, cv2.HISTCMP_CORREL))
                for i, e in enumerate(self.entries)
            }
            for i in sorted(correlations, key=lambda i: -correlations[i]):
                if correlations[i] >= HISTOGRAM_MIN_CORRELATION:
                    found[i] = self._match(i, "similar_colours", correlations[i])
        return list(found.values())[:top_k]

    def _match(self, i: int, kind: str, score: float) -> Match:
        entry = self.entries[i]
        return Match(entry.title, entry.caption, entry.page_id, kind, round(score, 4))


def _cache_path(collection: Path) -> Path:
    return collection.with_name(collection.name + ".features.npz")


def _cache_key(collection: Path, records: list[tuple[int, dict]], max_pixels: int) -> str:
    """What the features depend on: the collection's bytes, each image file's size and mtime, the pixel
    limit, the feature settings and OpenCV's version (ORB's output may change with it)."""
    digest = hashlib.sha256(collection.read_bytes())
    for _, record in records:
        try:
            stat = os.stat(collection.parent / record["image"])
            digest.update(f"{record['image']}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{record['image']}:missing\n".encode())
    digest.update(f"{max_pixels}:{FEATURE_SIDE}:{ORB_MIN_SIDE}:{ORB_FEATURES}:{cv2.__version__}".encode())
    return digest.hexdigest()


def _read_entries(cache: Path, key: str, names: list[tuple[str, str, str]]) -> list[Entry] | None:
    try:
        with np.load(cache, allow_pickle=False) as file:
            data = {name: file[name] for name in file.files}  # an NpzFile reads an array at every lookup
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    try:
        if str(data["key"]) != key or len(data["phash"]) != len(names):
            return None
        keypoint_ends, descriptor_ends = np.cumsum(data["counts"]), np.cumsum(data["descriptor_counts"])
        keypoint_starts, descriptor_starts = keypoint_ends - data["counts"], descriptor_ends - data["descriptor_counts"]
        return [
            Entry(
                *name,
                data["phash"][i : i + 1],
                data["keypoints"][keypoint_starts[i] : keypoint_ends[i]],
                data["descriptors"][descriptor_starts[i] : descriptor_ends[i]] if data["has_descriptors"][i] else None,
                data["histogram"][i],
            )
            for i, name in enumerate(names)
        ]
    except (KeyError, ValueError, IndexError):
        return None


def _write_entries(cache: Path, key: str, entries: list[Entry]) -> None:
    """Atomically (workers that start together may each write it); a read-only world goes uncached, and
    an empty collection needs no cache."""
    if not entries:
        return
    no_descriptors = np.zeros((0, 32), np.uint8)
    try:
        with tempfile.NamedTemporaryFile(dir=cache.parent, prefix=cache.name, suffix=".tmp", delete=False) as file:
            np.savez(
                file,
                key=np.array(key),
                phash=np.concatenate([e.phash for e in entries]),
                histogram=np.stack([e.histogram for e in entries]),
                counts=np.array([len(e.keypoints) for e in entries], np.int64),
                descriptor_counts=np.array(
                    [0 if e.descriptors is None else len(e.descriptors) for e in entries], np.int64
                ),
                keypoints=np.concatenate([e.keypoints for e in entries]),
                descriptors=np.concatenate(
                    [no_descriptors if e.descriptors is None else e.descriptors for e in entries]
                ),
                has_descriptors=np.array([e.descriptors is not None for e in entries], bool),
            )
        os.replace(file.name, cache)
    except OSError:
        with contextlib.suppress(OSError, NameError):
            os.unlink(file.name)


@functools.cache
def _load_index(path: str, mtime_ns: int, max_pixels: int) -> NearDuplicateIndex:
    return NearDuplicateIndex.from_jsonl(path, max_pixels)


def offline_image_search(image: np.ndarray, top_k: int, config: ImageSearchConfig, max_pixels: int) -> list[Match]:
    if not config.collection_path:
        raise BackendError("offline image search needs ImageSearchConfig.collection_path")
    if not os.path.isfile(config.collection_path):
        raise BackendError(f"image collection {config.collection_path} does not exist")
    try:
        index = _load_index(config.collection_path, os.stat(config.collection_path).st_mtime_ns, max_pixels)
    except (OSError, ValueError) as err:
        raise BackendError(f"image collection unusable: {err}") from None
    return index.search(image, top_k)


def online_image_search(image: np.ndarray, top_k: int, config: ImageSearchConfig, http: HttpConfig) -> list[Match]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    png = encode_png(image)
    if config.upload_url:
        uploaded = request_json(
            "image upload",
            "POST",
            config.upload_url,
            http,
            json_body={"image_base64": base64.b64encode(png).decode("ascii")},
            headers=headers,
        )
        if not isinstance(uploaded, dict) or not isinstance(uploaded.get("url"), str):
            raise BackendError("image upload response has no 'url'")
        body: dict[str, Any] = {"image_url": uploaded["url"], "top_k": top_k}
    else:
        body = {"image_base64": base64.b64encode(png).decode("ascii"), "top_k": top_k}
    payload = request_json("reverse image search", "POST", config.api_url or "", http, json_body=body, headers=headers)
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list):
        raise BackendError("reverse image search response has no 'results' list")
    matches = []
    for item in results[:top_k]:
        if not isinstance(item, dict) or not isinstance(item.get("title"), str):
            raise BackendError("reverse image search result without a 'title'")
        matches.append(
            Match(
                item["title"],
                str(item.get("caption") or item.get("snippet") or ""),
                str(item.get("page_id") or item.get("url") or ""),
                "web",
                float(item.get("score", 0.0)),
            )
        )
    return matches


def render_matches(matches: list[Match]) -> str:
    return "\n\n".join(
        f"[Match {i}] {m.title} (page: {m.page_id}; {m.kind}, score {m.score:g})\nCaption: {m.caption}"
        for i, m in enumerate(matches, 1)
    )


def image_search_tool(arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig) -> ToolOutput:
    settings = config.image_search
    if settings.backend == "online":
        matches = online_image_search(images[0], arguments["top_k"], settings, config.http)
    else:
        matches = offline_image_search(images[0], arguments["top_k"], settings, config.limits.max_image_pixels)
    if not matches:
        raise ToolError("no visual matches; try cropping the object of interest first")
    return ToolOutput(text=render_matches(matches))
