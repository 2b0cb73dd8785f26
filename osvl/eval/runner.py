"""Runs an answerer and a judge over benchmark items: per-item JSONL records, resumable, bounded.

``records.jsonl`` gets one line per finished item (the last line for an item wins), with its
trajectory (images in ``images/`` by content hash), answer, verdict, counts and latencies. Each
record has a ``status``:

- ``judged``: the verdict has a score; counted in Pass@1; skipped when the run is resumed.
- ``unjudged``: the judge could not answer (outage); left out of Pass@1; on resume the stored
  answer is judged again without regenerating.
- ``infra_error``: the engine failed; left out of Pass@1; regenerated on resume.
- ``bad_input``: the item's image could not be decoded; left out of Pass@1, reported.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osvl.eval.items import EvalItem, to_prompt
from osvl.eval.judge import AnswerJudge
from osvl.eval.modes import Answerer, Attempt
from osvl.rl.judges import Verdict
from osvl.rl.trajectory import ImageStore, trajectory_to_dict
from osvl.rollout.engine import derive_seed

RECORDS = "records.jsonl"
STATUSES = ("judged", "unjudged", "infra_error", "bad_input")


@dataclass(frozen=True)
class EvalRunConfig:
    concurrency: int = 4  # items in flight (generation and tools)
    judge_concurrency: int = 8  # judge requests in flight
    seed: int = 0
    progress_every_s: float = 10.0  # a progress line on stderr at most this often, and one at the end; 0 = none

    def __post_init__(self) -> None:
        if self.progress_every_s < 0:
            raise ValueError(f"progress_every_s must be >= 0, got {self.progress_every_s}")
        if self.concurrency < 1 or self.judge_concurrency < 1:
            raise ValueError(
                f"concurrency and judge_concurrency must be >= 1, got {self.concurrency} and {self.judge_concurrency}"
            )


@dataclass
class RunStats:
    """What this invocation did (a resumed run reports only its own work)."""

    generated: int = 0
    rejudged: int = 0
    skipped: int = 0  # already judged in an earlier run
    wall_s: float = 0.0
    max_in_flight: int = 0
    corrupt_lines: int = 0  # unreadable record lines (a run killed mid-write)


def read_records(path: str | os.PathLike[str]) -> tuple[dict[str, dict[str, Any]], int]:
    """The last record per item key, and how many lines could not be read."""
    records: dict[str, dict[str, Any]] = {}
    corrupt = 0
    if not Path(path).is_file():
        return records, corrupt
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records[f"{record['benchmark']}/{record['id']}"] = record
            except (ValueError, KeyError, TypeError):
                corrupt += 1
    return records, corrupt


def verdict_dict(verdict: Verdict) -> dict[str, Any]:
    return {"score": verdict.score, "reason": verdict.reason, "attempts": verdict.attempts, "judge": verdict.judge}


def status_of(verdict: Verdict) -> str:
    return "judged" if verdict.scored else "unjudged"


class Evaluator:
    """Holds the answerer, the judge and the output directory for one run."""

    def __init__(
        self,
        answerer: Answerer,
        judge: AnswerJudge,
        out_dir: str | os.PathLike[str],
        config: EvalRunConfig = EvalRunConfig(),
    ) -> None:
        self.answerer, self.judge, self.config = answerer, judge, config
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / RECORDS
        self.store = ImageStore(self.out_dir / "images")
        self.stats = RunStats()
        self._in_flight = 0
        self._progress = Counter()  # records written this run, by status; "right": summed judged scores
        self._total, self._started, self._reported = 0, 0.0, 0.0

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self._progress[record["status"]] += 1
        if record["status"] == "judged":
            self._progress["right"] += record["verdict"]["score"]
        self._report()

    def progress_line(self) -> str:
        """Where the run stands: items finished of those it took on, the running accuracy over the judged ones."""
        p = self._progress
        finished = p["judged"] + p["unjudged"] + p["infra_error"] + p["bad_input"]
        accuracy = f"{p['right'] / p['judged']:.3f}" if p["judged"] else "-"
        return (
            f"osvl.eval: {finished}/{self._total} items ({self.stats.skipped} judged before), running accuracy "
            f"{accuracy} over {p['judged']} judged; {p['unjudged']} unjudged, {p['infra_error']} infra errors, "
            f"{p['bad_input']} bad inputs; {time.monotonic() - self._started:.0f} s"
        )

    def _report(self, final: bool = False) -> None:
        every = self.config.progress_every_s
        if every and (final or time.monotonic() - self._reported >= every):
            self._reported = time.monotonic()
            print(self.progress_line(), file=sys.stderr, flush=True)

    async def _judge(self, item: EvalItem, answer: str | None, gate: asyncio.Semaphore) -> tuple[Verdict, float]:
        async with gate:
            started = time.monotonic()
            verdict = await asyncio.to_thread(self.judge.judge, item, answer)
            return verdict, time.monotonic() - started

    def _base(self, item: EvalItem) -> dict[str, Any]:
        return {
            "benchmark": item.benchmark,
            "id": item.id,
            "mode": self.answerer.mode,
            "question": item.question,
            "references": list(item.answers),
        }

    async def _generate(self, item: EvalItem, gate: asyncio.Semaphore, judge_gate: asyncio.Semaphore) -> None:
        async with gate:
            self._in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self._in_flight)
            try:
                try:
                    prompt = to_prompt(item)
                except ValueError as error:
                    self._write({**self._base(item), "status": "bad_input", "error": str(error)})
                    return
                started = time.monotonic()
                attempt: Attempt = await self.answerer.attempt(prompt, derive_seed(0, item.key, 0, self.config.seed))
                latency = time.monotonic() - started
                self.stats.generated += 1
            finally:
                self._in_flight -= 1
        record = {
            **self._base(item),
            "answer": attempt.answer,
            "finish_reason": attempt.trajectory.finish_reason.value,
            "tool_calls": attempt.tool_calls,
            "generated_tokens": attempt.generated_tokens,
            "context_tokens": attempt.context_tokens,
            "latency_s": latency,
            "retrieval": attempt.retrieval,
            "trajectory": trajectory_to_dict(attempt.trajectory, self.store),
        }
        if attempt.infra_error:
            self._write({**record, "status": "infra_error", "verdict": None, "judge_latency_s": 0.0})
            return
        verdict, judge_latency = await self._judge(item, attempt.answer, judge_gate)
        self._write(
            {**record, "status": status_of(verdict), "verdict": verdict_dict(verdict), "judge_latency_s": judge_latency}
        )

    async def _rejudge(self, item: EvalItem, record: dict[str, Any], judge_gate: asyncio.Semaphore) -> None:
        verdict, judge_latency = await self._judge(item, record.get("answer"), judge_gate)
        self._write(
            {**record, "status": status_of(verdict), "verdict": verdict_dict(verdict), "judge_latency_s": judge_latency}
        )
        self.stats.rejudged += 1

    async def run(self, items: Sequence[EvalItem]) -> RunStats:
        keys = [item.key for item in items]
        if len(set(keys)) != len(keys):
            raise ValueError("item keys (benchmark/id) must be unique within a run")
        started = time.monotonic()
        done, self.stats.corrupt_lines = read_records(self.path)
        gate, judge_gate = asyncio.Semaphore(self.config.concurrency), asyncio.Semaphore(self.config.judge_concurrency)
        tasks = []
        for item in items:
            previous = done.get(item.key)
            status = previous.get("status") if previous else None
            if status == "judged":
                self.stats.skipped += 1
            elif status == "unjudged":
                tasks.append(self._rejudge(item, previous, judge_gate))
            else:
                tasks.append(self._generate(item, gate, judge_gate))
        self._total, self._started, self._reported = len(tasks), started, started
        await asyncio.gather(*tasks)
        self._report(final=True)
        self.stats.wall_s = time.monotonic() - started
        return self.stats
