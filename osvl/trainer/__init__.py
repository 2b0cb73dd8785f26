"""Training stages (SFT, GRPO), checkpoints, metrics and reports.

The exports load on first use (PEP 562), so importing one submodule (``osvl.trainer.flops``) does
not pull in the GRPO stage's rollout and tool stack, which needs OpenCV: a GPU image that has
only torch can still run the training step (bench/train_step.py).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "run_grpo": "grpo",
    "MetricsWriter": "metrics",
    "progress_line": "metrics",
    "read_metrics": "metrics",
    "build_optimizer": "optim",
    "build_scheduler": "optim",
    "lr_factor": "optim",
    "StageResult": "sft",
    "run_sft": "sft",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
