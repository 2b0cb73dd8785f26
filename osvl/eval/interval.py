"""Confidence intervals for accuracies measured on small evaluation sets.

The Wilson score interval: unlike the normal (Wald) interval it stays inside [0, 1] and keeps
close to its nominal coverage at small n and at proportions near 0 or 1, where evaluations of a
weak policy on 64 prompts live (0.078 on 64 prompts is [0.034, 0.170]).
"""

from __future__ import annotations

import math
from statistics import NormalDist


def wilson_interval(successes: float, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """(low, high) for a binomial proportion of `successes` in `trials`; (0, 1) when trials is 0."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if trials < 0 or not 0.0 <= successes <= max(trials, 0):
        raise ValueError(f"need 0 <= successes <= trials, got {successes} of {trials}")
    if trials == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    scale = 1.0 + z * z / trials
    center = (p + z * z / (2 * trials)) / scale
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / scale
    return max(0.0, center - half), min(1.0, center + half)
