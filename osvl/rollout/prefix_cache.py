"""Keys and values of finished generations, reused when a later request extends the same context.

Turn n+1 of a rollout is turn n's context + its generation + an observation: keeping the first
part's keys/values skips re-prefilling it (the images' vision tower included). An entry matches
when its ids are a proper prefix of the request's and its images are the request's first images
(same pixels); entries are evicted least-recently-used past a token budget and dropped on every
weight update, since they were computed by the old weights.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from osvl.data.image import ProcessedImage


def image_key(image: ProcessedImage) -> str:
    return hashlib.sha1(image.pixels.tobytes() + repr(image.grid_thw).encode()).hexdigest()


@dataclass
class Prefix:
    ids: tuple[int, ...]
    image_keys: tuple[str, ...]
    keys: list[torch.Tensor]  # per layer [N_kv, len(ids), H]
    values: list[torch.Tensor]


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int], images: Sequence[str]) -> Prefix | None:
        """The longest stored proper prefix of ``ids`` whose images lead ``images``."""
        ids = tuple(ids)
        best = None
        for entry in self._entries.values():
            n = len(entry.ids)
            if (
                n < len(ids)
                and (best is None or n > len(best.ids))
                and ids[:n] == entry.ids
                and tuple(images[: len(entry.image_keys)]) == entry.image_keys
            ):
                best = entry
        if best is not None:
            self._entries.move_to_end(best.ids)
            self.hits += 1
            self.reused_tokens += len(best.ids)
        return best

    def store(self, entry: Prefix) -> None:
        if len(entry.ids) > self.max_tokens:
            return
        old = self._entries.pop(entry.ids, None)
        self._tokens += len(entry.ids) - (len(old.ids) if old is not None else 0)
        self._entries[entry.ids] = entry
        while self._tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted.ids)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0
