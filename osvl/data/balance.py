"""Pure partitioning algorithms behind the packer: bin packing and balanced k-way partition."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def first_fit_decreasing(
    costs: Sequence[int],
    budget: int,
    patches: Sequence[int] | None = None,
    max_patches: int | None = None,
) -> list[list[int]]:
    """Bins of item indices, each within ``budget`` (and ``max_patches`` of ``patches``).

    Largest item first, into the first bin it fits. Uses at most 11/9 OPT + 6/9 bins for the
    one-dimensional case. An item that fits no empty bin raises ValueError.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if patches is not None and len(patches) != len(costs):
        raise ValueError(f"patches has {len(patches)} entries for {len(costs)} items")
    extra = list(patches) if patches is not None else [0] * len(costs)
    limit = max_patches if max_patches is not None else float("inf")
    for index, (cost, patch) in enumerate(zip(costs, extra)):
        if cost > budget or patch > limit:
            raise ValueError(
                f"item {index} ({cost} tokens, {patch} patches) exceeds the per-bin budget "
                f"({budget} tokens, {max_patches} patches)"
            )
    bins: list[list[int]] = []
    loads: list[list[float]] = []  # [tokens, patches] per bin
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        for members, load in zip(bins, loads):
            if load[0] + costs[index] <= budget and load[1] + extra[index] <= limit:
                members.append(index)
                load[0] += costs[index]
                load[1] += extra[index]
                break
        else:
            bins.append([index])
            loads.append([costs[index], extra[index]])
    return bins


def karmarkar_karp(costs: Sequence[int], k: int) -> list[list[int]]:
    """k parts of item indices with near-equal cost sums (largest differencing method).

    Every item starts as a k-part state (itself plus k-1 empty parts); the two states with the
    largest spread are merged, pairing the heaviest part of one with the lightest of the other.
    A merge never widens the spread beyond its inputs', so max - min <= max(costs).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for index, cost in enumerate(costs):
        if cost < 0:
            raise ValueError(f"item {index} has negative cost {cost}")
        parts = [(cost, [index])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-cost, index, parts))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, tie, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda part: -part[0])
        b = sorted(b, key=lambda part: part[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie, merged))
    parts = heap[0][2]
    return [sorted(indices) for _, indices in sorted(parts, key=lambda part: -part[0])]
