"""Group-relative advantages with the fatal-aware one-sided clamp.

Group membership is resolved with a blocked [S, S] equality matrix instead of `torch.unique`,
so the whole computation stays on the device with no host synchronisation (S is the number of
trajectories in a batch: hundreds to a few thousand).
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "rloo", "drgrpo")
STD_CONVENTIONS = ("unbiased", "population")

# Rows of the equality matrix handled at once; bounds the extra memory to _BLOCK * S elements.
_BLOCK = 2048


def check_advantage_args(estimator: str, std: str, eps: float) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if std not in STD_CONVENTIONS:
        raise ValueError(f"unknown std convention {std!r}; expected one of {STD_CONVENTIONS}")
    if not eps >= 0.0:
        raise ValueError(f"adv_eps must be >= 0, got {eps}")


def _check_group_tensors(rewards: torch.Tensor, group_ids: torch.Tensor, is_fatal: torch.Tensor | None) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [S], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating tensor, got {rewards.dtype}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if is_fatal is not None:
        if is_fatal.shape != rewards.shape:
            raise ValueError(f"is_fatal shape {tuple(is_fatal.shape)} != rewards shape {tuple(rewards.shape)}")
        if is_fatal.dtype != torch.bool:
            raise ValueError(f"is_fatal must be a bool tensor, got {is_fatal.dtype}")


def group_scores(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: str = "grpo",
    std: str = "unbiased",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sequence advantages before the fatal clamp, in fp32 (statistics in fp64)."""
    check_advantage_args(estimator, std, eps)
    _check_group_tensors(rewards, group_ids, None)
    r = rewards.detach().to(torch.float64)
    out = torch.empty_like(r)
    for start in range(0, r.numel(), _BLOCK):
        rows = slice(start, start + _BLOCK)
        same = (group_ids[rows, None] == group_ids[None, :]).to(torch.float64)
        count = same.sum(dim=1)
        total = same @ r
        mine = r[rows]
        if estimator == "rloo":
            others = (count - 1).clamp_min(1)
            score = mine - (total - mine) / others
        else:
            mean = total / count
            score = mine - mean
            if estimator == "grpo":
                dof = (count - 1).clamp_min(1) if std == "unbiased" else count
                var = (same * (r[None, :] - mean[:, None]).square()).sum(dim=1) / dof
                score = score / (var.sqrt() + eps)
        out[rows] = torch.where(count > 1, score, torch.zeros_like(score))
    return out.to(torch.float32)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    is_fatal: torch.Tensor | None = None,
    *,
    estimator: str = "grpo",
    std: str = "unbiased",
    eps: float = 1e-6,
    clamp_fatal: bool = True,
) -> torch.Tensor:
    """Group-normalised advantages [S] (fp32); fatal sequences get max(A, 0) when `clamp_fatal`.

    Fatal sequences still count in their group's mean and std: the clamp only stops a crashed
    trajectory's sound prefix from being pushed down, it does not change what "average" means.
    """
    _check_group_tensors(rewards, group_ids, is_fatal)
    scores = group_scores(rewards, group_ids, estimator=estimator, std=std, eps=eps)
    if clamp_fatal and is_fatal is not None:
        scores = torch.where(is_fatal, scores.clamp_min(0.0), scores)
    return scores
