"""Scoring groups as they complete: judges on a bounded thread pool, verdicts cached.

The GRPO stage hands each finished group to ``GroupScorer.score_group`` while the step's other
rollouts still run, so judge latency overlaps generation. Each judge call is timed and counted;
a verdict is cached under (judge name with its prompt version, question, references, answer or
search calls), so a repeated answer costs no request. Unscored verdicts (outages) are not
cached: the next occurrence asks again. An outage leaves the sample unscored, never 0.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from osvl.rl.judges import AccuracyJudge, QueryJudge, Verdict, describe_calls
from osvl.rl.rewards import RewardConfig, score_trajectory
from osvl.rl.trajectory import Prompt, Step, Trajectory


@dataclass
class JudgeStats:
    """What the judges cost: calls answered by the judges (cache misses), cache hits, HTTP
    requests (retries included; 0 for offline judges), each call's latency, and the requests the
    endpoint answered with overload (429/503) that were asked again as back-pressure."""

    calls: int = 0
    cache_hits: int = 0
    requests: int = 0
    latencies_s: list[float] = field(default_factory=list)
    overloads: int = 0

    def take(self) -> JudgeStats:
        """The counts so far; this object starts again from zero."""
        taken = JudgeStats(self.calls, self.cache_hits, self.requests, self.latencies_s, self.overloads)
        self.calls = self.cache_hits = self.requests = self.overloads = 0
        self.latencies_s = []
        return taken

    @staticmethod
    def merge(parts: Sequence[JudgeStats]) -> JudgeStats:
        return JudgeStats(
            sum(p.calls for p in parts),
            sum(p.cache_hits for p in parts),
            sum(p.requests for p in parts),
            [x for p in parts for x in p.latencies_s],
            sum(p.overloads for p in parts),
        )

    def metrics(self, scored: Sequence[Trajectory]) -> dict[str, float]:
        """Per-step metrics; ``unscored_frac`` is the share of ``scored`` no judge could score."""
        rewards = [t.reward for t in scored if t.reward is not None]
        latencies = np.asarray(self.latencies_s or [0.0])
        return {
            "judge_calls": float(self.calls),
            "judge_requests": float(self.requests),
            "judge_cache_hits": float(self.cache_hits),
            "judge_overloads": float(self.overloads),
            "judge_p50_s": float(np.percentile(latencies, 50)),
            "judge_p99_s": float(np.percentile(latencies, 99)),
            "unscored_frac": sum(not r.scored for r in rewards) / max(len(rewards), 1),
        }


class VerdictCache:
    """A bounded, thread-safe LRU of scored verdicts."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple, Verdict] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Verdict | None:
        with self._lock:
            verdict = self._items.get(key)
            if verdict is not None:
                self._items.move_to_end(key)
            return verdict

    def put(self, key: tuple, verdict: Verdict) -> None:
        if not verdict.scored or self.capacity == 0:
            return
        with self._lock:
            self._items[key] = verdict
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)


class _Counted:
    """A judge seen through the cache and the step's counters (same interface as the judge)."""

    def __init__(self, accuracy: AccuracyJudge, query: QueryJudge, cache: VerdictCache, stats: JudgeStats) -> None:
        self.accuracy, self.query, self.cache, self.stats = accuracy, query, cache, stats
        self.lock = threading.Lock()  # guards stats

    def _ask(self, key: tuple, call) -> Verdict:
        cached = self.cache.get(key)
        if cached is not None:
            with self.lock:
                self.stats.cache_hits += 1
            return cached
        start = time.perf_counter()
        verdict = call()
        with self.lock:
            self.stats.calls += 1
            self.stats.requests += verdict.attempts
            self.stats.overloads += verdict.overloads
            self.stats.latencies_s.append(time.perf_counter() - start)
        self.cache.put(key, verdict)
        return verdict

    def judge_answer(self, prompt: Prompt, response: str) -> Verdict:
        key = (
            "accuracy",
            getattr(self.accuracy, "name", type(self.accuracy).__name__),
            prompt.question,
            tuple(prompt.accepted_answers),
            response,
        )
        return self._ask(key, lambda: self.accuracy.judge_answer(prompt, response))

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        key = ("query", getattr(self.query, "name", type(self.query).__name__), prompt.question, describe_calls(steps))
        return self._ask(key, lambda: self.query.judge_queries(prompt, steps))


class GroupScorer:
    """Scores trajectories on ``max_concurrency`` judge threads; ``close`` when done."""

    def __init__(
        self,
        accuracy: AccuracyJudge,
        query: QueryJudge,
        config: RewardConfig,
        *,
        max_concurrency: int = 32,
        cache_size: int = 100_000,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.config = config
        self.stats = JudgeStats()
        self.judges = _Counted(accuracy, query, VerdictCache(cache_size), self.stats)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="osvl-judge")

    async def score_group(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """The group's trajectories with rewards filled in, in order."""
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(
                *(
                    loop.run_in_executor(self._pool, score_trajectory, t, self.judges, self.judges, self.config)
                    for t in trajectories
                )
            )
        )

    def describe(self) -> str:
        """The judges' counts since the last ``take_stats``, read without taking them."""
        with self.judges.lock:
            s = self.stats
            return (
                f"{s.calls} verdicts from the judges ({s.requests} requests, {s.overloads} overloaded), "
                f"{s.cache_hits} cached"
            )

    def take_stats(self) -> JudgeStats:
        """The judges' counts since the last call; judging may go on meanwhile (asynchronous GRPO)."""
        with self.judges.lock:
            return self.stats.take()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
