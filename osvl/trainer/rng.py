"""The process's random generators (Python's, NumPy's global, torch's): seeded from the job seed at a
fresh start, captured into and restored from every checkpoint, so a fresh run and a resumed one
draw the same numbers."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_generators(seed: int) -> None:
    """Seeds every generator a run may draw from (torch's on every device) from the job seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
