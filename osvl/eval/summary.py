"""Per-benchmark Pass@1 and cost from the records, and the table in the paper's Table 2 layout.

Pass@1 = correct / judged: unjudged (judge outage), infra-error and bad-input items are counted
and shown but never enter the denominator. The paper's numbers (``data/paper_table2.json``,
arXiv 2605.05185 Table 2) are printed beside ours for the same workflow wherever a benchmark
matches one of its columns, each row labelled as the paper's.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import Any

PAPER_COLUMNS = ("SimpleVQA", "VDR", "MMSearch", "LiveVQA", "BrowseComp-VL", "FVQA", "InfoSeek")
SECTION_TITLES = {"direct": "Direct Reasoning", "rag": "RAG Workflow", "agentic": "Agentic Workflow"}


@dataclass
class BenchmarkSummary:
    benchmark: str
    column: str | None  # the paper's column for this benchmark, if any
    items: int = 0  # items with a record
    rejected_at_load: int = 0
    judged: int = 0
    correct: float = 0.0  # sum of scores (judges give 0 or 1)
    unjudged: int = 0
    infra_error: int = 0
    bad_input: int = 0
    no_answer: int = 0
    unjudged_reasons: dict[str, int] = field(default_factory=dict)
    tool_calls_per_item: float = 0.0
    generated_tokens_per_item: float = 0.0
    context_tokens_per_item: float = 0.0
    latency_mean_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    judge_latency_mean_s: float = 0.0
    judge_requests: int = 0

    @property
    def pass_at_1(self) -> float | None:
        """Percent over judged items; None when nothing was judged."""
        return 100.0 * self.correct / self.judged if self.judged else None


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def summarize_benchmark(
    benchmark: str, column: str | None, records: Sequence[Mapping[str, Any]], rejected_at_load: int = 0
) -> BenchmarkSummary:
    out = BenchmarkSummary(benchmark, column, items=len(records), rejected_at_load=rejected_at_load)
    reasons: Counter[str] = Counter()
    ran = [r for r in records if r.get("status") in ("judged", "unjudged")]
    for record in records:
        status = record.get("status")
        verdict = record.get("verdict") or {}
        if status == "judged":
            out.judged += 1
            out.correct += float(verdict["score"])
            out.no_answer += verdict.get("reason") == "no_answer"
        elif status == "unjudged":
            out.unjudged += 1
            reasons[verdict.get("reason") or "unknown"] += 1
        elif status == "infra_error":
            out.infra_error += 1
        elif status == "bad_input":
            out.bad_input += 1
        out.judge_requests += int(verdict.get("attempts") or 0)
    out.unjudged_reasons = dict(sorted(reasons.items()))
    latencies = [float(r["latency_s"]) for r in ran]
    out.tool_calls_per_item = _mean([r["tool_calls"] for r in ran])
    out.generated_tokens_per_item = _mean([r["generated_tokens"] for r in ran])
    out.context_tokens_per_item = _mean([r["context_tokens"] for r in ran])
    out.latency_mean_s = _mean(latencies)
    out.latency_p50_s = _quantile(latencies, 0.5)
    out.latency_p90_s = _quantile(latencies, 0.9)
    out.judge_latency_mean_s = _mean([float(r["judge_latency_s"]) for r in ran])
    return out


@cache
def paper_table() -> dict[str, Any]:
    """The paper's Table 2 (source, metric, columns, rows per workflow)."""
    text = resources.files("osvl.eval").joinpath("data", "paper_table2.json").read_text(encoding="utf-8")
    return json.loads(text)


def _fmt(value: float | None, mark: str = "") -> str:
    return "–" if value is None else f"{value:.1f}{mark}"


def average(values: Sequence[float | None]) -> float | None:
    """Mean of the row, or None when any entry is missing (the paper prints '–' then)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(values)


def pass_table(summaries: Sequence[BenchmarkSummary], mode: str, label: str) -> str:
    """Markdown: our Pass@1 row, then the paper's rows of the same workflow on matching columns."""
    # the paper's columns in its order, then ours that have no paper counterpart
    ordered = sorted(
        summaries, key=lambda s: PAPER_COLUMNS.index(s.column) if s.column in PAPER_COLUMNS else len(PAPER_COLUMNS)
    )
    headers = [s.column or s.benchmark for s in ordered]
    ours = [s.pass_at_1 for s in ordered]
    lines = [
        f"| Model | {' | '.join(headers)} | Avg |",
        "|---" * (len(headers) + 2) + "|",
        f"| **{label}** | {' | '.join(_fmt(v) for v in ours)} | {_fmt(average(ours))} |",
    ]
    matched = [s.column for s in ordered if s.column in PAPER_COLUMNS]
    full = sorted(matched) == sorted(PAPER_COLUMNS) and len(ordered) == len(PAPER_COLUMNS)
    table = paper_table()
    if matched:
        for row in table["rows"].get(mode, []):
            cells = [row["scores"].get(s.column) if s.column in PAPER_COLUMNS else None for s in ordered]
            if full:
                avg, mark = row["avg"], ""
            else:
                avg, mark = average([row["scores"].get(c) for c in matched]), "†"
            lines.append(f"| paper: {row['model']} | {' | '.join(_fmt(v) for v in cells)} | {_fmt(avg, mark)} |")
        section = SECTION_TITLES.get(mode, mode)
        lines += [
            "",
            (
                f"Rows marked `paper:` are the paper's reported numbers ({table['source']}, "
                f"{section} section; {table['metric']}), not results of this run."
            ),
        ]
        if not full:
            lines.append("† mean of the paper's scores on the matching columns shown, not its reported average.")
    else:
        lines += ["", "No benchmark in this run matches a column of the paper's Table 2; no paper numbers shown."]
    return "\n".join(lines)


def cost_table(summaries: Sequence[BenchmarkSummary]) -> str:
    """Markdown: counts by status and the cost/latency of each benchmark."""
    headers = [
        "Benchmark",
        "items",
        "judged",
        "correct",
        "unjudged",
        "infra error",
        "bad input",
        "rejected at load",
        "tool calls/item",
        "generated tokens/item",
        "context tokens/item",
        "latency mean/p50/p90 s",
        "judge requests",
    ]
    lines = [f"| {' | '.join(headers)} |", "|---" * len(headers) + "|"]
    for s in summaries:
        lines.append(
            f"| {s.benchmark} | {s.items} | {s.judged} | {s.correct:g} | {s.unjudged} | {s.infra_error} "
            f"| {s.bad_input} | {s.rejected_at_load} | {s.tool_calls_per_item:.2f} "
            f"| {s.generated_tokens_per_item:.1f} | {s.context_tokens_per_item:.1f} "
            f"| {s.latency_mean_s:.2f}/{s.latency_p50_s:.2f}/{s.latency_p90_s:.2f} | {s.judge_requests} |"
        )
    return "\n".join(lines)


def summary_dict(summaries: Sequence[BenchmarkSummary], **run: Any) -> dict[str, Any]:
    ours = [s.pass_at_1 for s in summaries]
    return {
        **run,
        "average_pass_at_1": average(ours),
        "benchmarks": [{**asdict(s), "pass_at_1": s.pass_at_1} for s in summaries],
    }
