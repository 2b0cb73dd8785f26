"""Record/replay of tool results in SQLite, so online searches are reproducible and cheap.

The key is the tool name, the validated arguments as canonical JSON, and the SHA-256 of every
input image. ``record`` serves hits and stores new ``ok`` results; ``replay`` serves hits only
and reports a miss as ``infra_error`` (a replayed run must not reach the web).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from osvl.rl.trajectory import ToolResult, ToolStatus, image_sha256

MODES = ("record", "replay")


def cache_key(tool: str, arguments: Mapping[str, Any], images: list[np.ndarray]) -> str:
    payload = json.dumps(
        {"tool": tool, "arguments": arguments, "images": [image_sha256(i) for i in images]},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _pack_images(images: list[np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, *images)
    return buffer.getvalue()


def _unpack_images(blob: bytes) -> list[np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as archive:
        return [archive[f"arr_{i}"] for i in range(len(archive.files))]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    stores: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class ToolCache:
    def __init__(self, path: str | os.PathLike[str], mode: str = "record") -> None:
        if mode not in MODES:
            raise ValueError(f"cache mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(os.fspath(path), check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, tool TEXT NOT NULL, "
            "arguments TEXT NOT NULL, text TEXT NOT NULL, images BLOB NOT NULL)"
        )
        self._db.commit()

    def lookup(self, tool: str, arguments: Mapping[str, Any], images: list[np.ndarray]) -> ToolResult | None:
        key = cache_key(tool, arguments, images)
        with self._lock:
            row = self._db.execute("SELECT text, images FROM results WHERE key = ?", (key,)).fetchone()
            if row is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
        return ToolResult(status=ToolStatus.OK, tool=tool, text=row[0], images=_unpack_images(row[1]))

    def store(self, tool: str, arguments: Mapping[str, Any], images: list[np.ndarray], result: ToolResult) -> None:
        """Keep ``ok`` results only: a failure is not a fact about the world worth replaying."""
        if self.mode != "record" or result.status is not ToolStatus.OK:
            return
        key = cache_key(tool, arguments, images)
        args_json = json.dumps(arguments, sort_keys=True, ensure_ascii=False)
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?)",
                (key, tool, args_json, result.text, _pack_images(result.images)),
            )
            self._db.commit()
            self.stats.stores += 1

    def close(self) -> None:
        with self._lock:
            self._db.close()
