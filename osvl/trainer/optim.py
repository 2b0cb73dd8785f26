"""AdamW and the learning-rate schedule (linear warmup, then cosine or constant)."""

from __future__ import annotations

import math

import torch

from osvl.config.recipe import OptimizerConfig, SchedulerConfig


def lr_factor(step: int, total_steps: int, config: SchedulerConfig) -> float:
    """Multiplier of the base lr at optimizer step ``step`` (0-based) of ``total_steps``."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    warmup = math.ceil(config.warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if config.kind == "constant":
        return 1.0
    progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_optimizer(params, config: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, foreach=True
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
