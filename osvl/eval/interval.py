"""Confidence intervals for accuracies measured on small evaluation sets.

The Wilson score interval: unlike the normal (Wald) interval it stays inside [0, 1] and keeps
close to its nominal coverage at small n and at proportions near 0 or 1, where evaluations of a
weak policy on 64 prompts live (0.078 on 64 prompts is [0.034, 0.170]).

The two-level bootstrap (:func:`bootstrap_interval`): for a study of several training seeds each
evaluated on the same prompts, an interval over both sources of variation, and for the paired
difference of two settings.

The cluster bootstrap (:func:`clustered_paired_difference`): questions drawn around shared entities are
not independent, so the paired difference is resampled by whole clusters (anchor entities) too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np


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


@dataclass(frozen=True)
class Estimate:
    """A statistic and its bootstrap interval (NaN where the statistic is undefined, e.g. no answers)."""

    value: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0


Table = tuple[np.ndarray, np.ndarray | None]  # numerator [seeds, prompts], and denominator (None = a mean)


def _ratio(numerator: np.ndarray, denominator: np.ndarray | None) -> np.ndarray:
    """Ratio of sums over the last two axes (seeds, prompts); NaN where the denominator sums to 0."""
    top = numerator.sum(axis=(-2, -1))
    if denominator is None:
        return top / (numerator.shape[-2] * numerator.shape[-1])
    bottom = denominator.sum(axis=(-2, -1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1), np.nan)


def _check_table(table: Table, prompts: int | None = None) -> Table:
    numerator, denominator = (
        np.asarray(table[0], dtype=np.float64),
        None if table[1] is None else np.asarray(table[1], dtype=np.float64),
    )
    if numerator.ndim != 2 or numerator.size == 0:
        raise ValueError(f"a table is [seeds, prompts] with both > 0, got shape {numerator.shape}")
    if denominator is not None and denominator.shape != numerator.shape:
        raise ValueError(f"denominator shape {denominator.shape} != numerator shape {numerator.shape}")
    if prompts is not None and numerator.shape[1] != prompts:
        raise ValueError(f"paired tables need the same prompts, got {prompts} and {numerator.shape[1]}")
    if not np.isfinite(numerator).all() or (denominator is not None and not np.isfinite(denominator).all()):
        raise ValueError("tables must hold finite numbers")
    return numerator, denominator


def _resampled(table: Table, seed_draws: np.ndarray, prompt_draws: np.ndarray) -> np.ndarray:
    numerator, denominator = table
    pick = lambda x: x[seed_draws[:, :, None], prompt_draws[:, None, :]]  # noqa: E731 - [B, S, P]
    return _ratio(pick(numerator), None if denominator is None else pick(denominator))


def _by_cluster(table: Table, clusters: Sequence[str]) -> Table:
    """The table's prompt columns summed within each cluster, the denominator with them (a mean's denominator
    is the prompt count), so that a ratio of sums over drawn clusters is the mean over their prompts."""
    numerator, denominator = table
    if len(clusters) != numerator.shape[1]:
        raise ValueError(f"{len(clusters)} clusters for {numerator.shape[1]} prompts: name one cluster per prompt")
    names, index = np.unique(np.asarray(clusters, dtype=str), return_inverse=True)
    if len(names) < 2:
        raise ValueError(f"a cluster bootstrap needs at least 2 clusters, got {len(names)}")
    summed = lambda x: np.stack([np.bincount(index, weights=row, minlength=len(names)) for row in x])  # noqa: E731
    return summed(numerator), summed(np.ones_like(numerator) if denominator is None else denominator)


def bootstrap_interval(
    table: Table,
    baseline: Table | None = None,
    *,
    clusters: Sequence[str] | None = None,
    resamples: int = 4000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """A mean (or a ratio of sums) over a [seeds, prompts] table with its two-level percentile bootstrap
    interval: seeds and prompts are both drawn with replacement, so the interval covers the runs'
    randomness and the evaluation set's. With ``baseline`` (another table on the same prompts) the
    estimate is the difference, with one prompt draw shared by both (paired); seeds are paired too when
    both tables have the same number of them (seed k of each setting drew the same sampling and fault
    streams: common random numbers), and drawn independently otherwise. With ``clusters`` (one name per
    prompt column, e.g. the question's anchor entity) whole clusters are drawn instead of prompts: questions
    about one entity share what the policy knows of it, and a draw by prompt makes the interval too narrow."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    table = _check_table(table)
    if baseline is not None:
        baseline = _check_table(baseline, table[0].shape[1])
    if clusters is not None:
        table = _by_cluster(table, clusters)
        baseline = None if baseline is None else _by_cluster(baseline, clusters)
    seeds, prompts = table[0].shape
    value = float(_ratio(*table))
    rng = np.random.default_rng(seed)
    prompt_draws = rng.integers(0, prompts, size=(resamples, prompts))
    seed_draws = rng.integers(0, seeds, size=(resamples, seeds))
    samples = _resampled(table, seed_draws, prompt_draws)
    if baseline is not None:
        other = baseline[0].shape[0]
        if other != seeds:
            seed_draws = rng.integers(0, other, size=(resamples, other))
        value -= float(_ratio(*baseline))
        samples = samples - _resampled(baseline, seed_draws, prompt_draws)
    samples = samples[np.isfinite(samples)]
    if not math.isfinite(value) or samples.size < resamples // 2:
        return Estimate(value, math.nan, math.nan)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Estimate(value, float(low), float(high))


RIGHT = 0.5  # an answer is right at accuracy >= RIGHT (exact-match and LLM judges give 0 or 1)


def _check_same_prompts(first: Mapping[str, Any], second: Mapping[str, Any], what: str) -> None:
    if set(first) != set(second):
        differ = sorted(set(first) ^ set(second))
        raise ValueError(f"{what} need the same prompts; {len(differ)} differ, e.g. {differ[:3]}")


def pass_at_k(samples: Iterable[Sequence[float | None]], k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) averaged over prompts: for a prompt with c right answers
    among its n scored samples, 1 - C(n - c, k) / C(n, k), the chance that k of them drawn without
    replacement hold a right one. A sample is right when its accuracy is >= 0.5 (exact-match and
    LLM judges give 0 or 1); unscored samples (None) are left out, and so are prompts with fewer than
    k scored samples; NaN when no prompt is left."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    values = []
    for accuracies in samples:
        scored = [a for a in accuracies if a is not None]
        n, right = len(scored), sum(a >= RIGHT for a in scored)
        if n >= k:
            values.append(1.0 - math.comb(n - right, k) / math.comb(n, k))
    return float(np.mean(values)) if values else math.nan


@dataclass(frozen=True)
class SharpeningRoom:
    """How open a policy's greedy answers are to sharpening its samples (:func:`sharpening_room`)."""

    prompts: int  # scored greedily and by at least one sample
    greedy_wrong: int
    wrong_sampled_right: int  # greedy misses that at least one sample answers
    greedy_right: int
    right_sampled_minority: int  # greedy answers that fewer than half the samples give


def sharpening_room(
    greedy: Mapping[str, float | None], sampled: Mapping[str, Sequence[float | None]]
) -> SharpeningRoom:
    """Greedy answers (prompt id -> accuracy) against samples of the same policy (prompt id -> their
    accuracies). RL raises the probability of the right answers it samples, so a greedy miss it can turn
    is one the policy sometimes answers, and a greedy answer it can lose is one the policy seldom gives:
    measured before training, the counts say how much of the greedy score is open to it. A few samples
    undercount the open misses (in three 96-question pilots with 4 samples, 2 of GRPO's 9 greedy gains
    were among them: docs/demo.md). Right means accuracy >= 0.5, as in :func:`pass_at_k`; prompts
    unscored greedily or in every sample are left out."""
    _check_same_prompts(greedy, sampled, "greedy and sampled evaluations")
    wrong = wrong_sampled = right = right_minority = 0
    for prompt, accuracy in greedy.items():
        samples = [a >= RIGHT for a in sampled[prompt] if a is not None]
        if accuracy is None or not samples:
            continue
        if accuracy >= RIGHT:
            right += 1
            right_minority += 2 * sum(samples) < len(samples)
        else:
            wrong += 1
            wrong_sampled += any(samples)
    if not wrong + right:
        raise ValueError("no prompt is scored both greedily and in a sample")
    return SharpeningRoom(wrong + right, wrong, wrong_sampled, right, right_minority)


def paired_difference(
    after: Mapping[str, float | None], before: Mapping[str, float | None], **bootstrap: Any
) -> Estimate:
    """Mean accuracy of ``after`` minus ``before`` on the same prompts (prompt id -> accuracy), with the
    paired percentile bootstrap over prompts (:func:`bootstrap_interval` with one seed each). Prompts
    either side left unscored (None) are left out of both."""
    _check_same_prompts(after, before, "paired evaluations")
    prompts = sorted(p for p in after if after[p] is not None and before[p] is not None)
    if not prompts:
        raise ValueError("no prompt is scored in both evaluations")
    table = lambda accs: (np.array([[float(accs[p]) for p in prompts]]), None)  # noqa: E731 - [1 seed, prompts]
    return bootstrap_interval(table(after), table(before), **bootstrap)


def clustered_paired_difference(
    after: Mapping[str, float | None] | Sequence[Mapping[str, float | None]],
    before: Mapping[str, float | None] | Sequence[Mapping[str, float | None]],
    clusters: Mapping[str, str],
    *,
    resamples: int = 4000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """Mean accuracy of ``after`` minus ``before`` (prompt id -> accuracy; or one mapping per run, paired run by
    run, e.g. each SFT seed with its own GRPO) with a percentile bootstrap that draws whole clusters of prompts
    (``clusters``: prompt id -> cluster, e.g. the question's anchor entity) and, with several runs, the runs:
    questions about one entity share what the policy knows of it, so they are not independent draws and a
    bootstrap over prompts is too narrow. A prompt unscored (None) in a run's pair is left out of that run."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    afters = [after] if isinstance(after, Mapping) else list(after)
    befores = [before] if isinstance(before, Mapping) else list(before)
    if len(afters) != len(befores) or not afters:
        raise ValueError(f"{len(afters)} runs after against {len(befores)} before: pair each run with its own")
    for a, b in zip(afters, befores, strict=True):
        _check_same_prompts(a, b, "paired evaluations")
        _check_same_prompts(a, afters[0], "the runs' evaluations")
    unclustered = sorted(p for p in afters[0] if p not in clusters)
    if unclustered:
        raise ValueError(f"{len(unclustered)} prompts have no cluster, e.g. {unclustered[:3]}")
    names = sorted({clusters[p] for p in afters[0]})
    if len(names) < 2:
        raise ValueError(f"a cluster bootstrap needs at least 2 clusters, got {len(names)}")
    index = {name: i for i, name in enumerate(names)}
    diff_sums = np.zeros((len(afters), len(names)))
    counts = np.zeros((len(afters), len(names)))
    for run, (a, b) in enumerate(zip(afters, befores, strict=True)):
        for prompt, value in a.items():
            if value is not None and b[prompt] is not None:
                diff_sums[run, index[clusters[prompt]]] += float(value) - float(b[prompt])
                counts[run, index[clusters[prompt]]] += 1
    if not counts.sum():
        raise ValueError("no prompt is scored in both evaluations")
    value = float(diff_sums.sum() / counts.sum())
    rng = np.random.default_rng(seed)
    run_draws = rng.integers(0, len(afters), size=(resamples, len(afters)))
    cluster_draws = rng.integers(0, len(names), size=(resamples, len(names)))
    pick = lambda x: x[run_draws[:, :, None], cluster_draws[:, None, :]].sum(axis=(1, 2))  # noqa: E731 - [B]
    drawn = pick(counts)
    samples = pick(diff_sums)[drawn > 0] / drawn[drawn > 0]
    if samples.size < resamples // 2:
        return Estimate(value, math.nan, math.nan)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Estimate(value, float(low), float(high))
