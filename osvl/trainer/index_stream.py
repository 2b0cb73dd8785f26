"""The order both stages draw their items in: global batches of indices, resumable mid-epoch.

The SFT stage draws trajectory indices (``sft.global_batch`` per step), the GRPO stage prompt
indices (``grpo.batch_prompts`` per step); the cursor is checkpointed with the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Cursor:
    """Where the stream is: epoch and position in that epoch's permutation."""

    epoch: int = 0
    index: int = 0


class IndexStream:
    """Global batches of item indices; epoch e is a permutation seeded by (seed, e)."""

    def __init__(self, num_items: int, global_batch: int, seed: int, shuffle: bool = True) -> None:
        if global_batch > num_items:
            raise ValueError(f"a global batch of {global_batch} exceeds the {num_items} items")
        self.num_items, self.global_batch, self.seed, self.shuffle = num_items, global_batch, seed, shuffle
        self.cursor = Cursor()

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.global_batch  # a ragged tail is dropped, as with drop_last

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_batch(self) -> list[int]:
        if self.cursor.index + self.global_batch > self.num_items:
            self.cursor = Cursor(self.cursor.epoch + 1, 0)
        start = self.cursor.index
        self.cursor = Cursor(self.cursor.epoch, start + self.global_batch)
        return self._order(self.cursor.epoch)[start : start + self.global_batch].tolist()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.cursor.epoch, "index": self.cursor.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.cursor = Cursor(int(state["epoch"]), int(state["index"]))
