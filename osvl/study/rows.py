"""The evaluation rows of the study's finished runs, read back by setting and seed for the report and the
power analysis: per-prompt statistics (:class:`Metric`) as [seeds, prompts] tables, with each prompt's
cluster (its anchor entity) for the bootstrap."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from osvl.eval.interval import Table
from osvl.jsonl import iter_jsonl
from osvl.study.runs import DONE, ROWS, SFT_RUN, StudyConfig, plan, run_dir

MAIN_CHOICE = "all/keep"  # the paper's: every error counts toward the fatal rule, outage-hit rollouts are kept


@dataclass(frozen=True)
class Metric:
    """A per-prompt statistic: numerator over denominator (None: over all prompts)."""

    name: str
    numerator: str
    denominator: str | None = None


ACCURACY = Metric("accuracy", "correct")
CALLS = Metric("tool calls per answer", "answer_calls", "answered")
LOOKUPS = Metric("2-hop questions with every lookup issued", "looked_up_2hop", "is_2hop")
GROUNDED = Metric("grounded answers", "grounded", "answered")
TOOL_USE = (
    CALLS,
    LOOKUPS,
    Metric("answers without a tool", "no_tool_answer", "answered"),
    GROUNDED,
    Metric("answered", "answered"),
)


def _value(row: dict, key: str) -> float:
    if key == "answer_calls":  # tool calls made by rollouts that answered
        return float(row["tool_calls"]) if row["answered"] else 0.0
    if key == "is_2hop":
        return float(row.get("hops") == 2 and row.get("lookups") is not None)
    if key == "looked_up_2hop":  # the habit the demo's SFT plants and its GRPO undoes (docs/demo.md)
        lookups = row.get("lookups")
        return float(row.get("hops") == 2 and lookups is not None and lookups[0] == lookups[1])
    value = row[key]
    return 0.0 if value is None else float(value)


@dataclass
class StudyRows:
    """Every finished run's evaluation rows, by setting ``(outage rate, choice, mode)`` and seed; ``clusters``:
    each prompt's anchor entity (the prompt itself where the prompts name none), what the bootstrap draws."""

    prompts: list[str]
    clusters: list[str]
    settings: dict[tuple[float, str, str], dict[int, dict[str, dict]]]
    sft: dict[str, dict] | None
    done: int
    planned: int

    def table(self, key: tuple[float, str, str] | None, metric: Metric) -> Table | None:
        """[seeds, prompts] of the setting (None: the SFT checkpoint), or None when nothing finished."""
        runs = [self.sft] if key is None else [self.settings[key][s] for s in sorted(self.settings.get(key, {}))]
        runs = [r for r in runs if r is not None]
        if not runs:
            return None
        numerator = np.array([[_value(r[p], metric.numerator) for p in self.prompts] for r in runs])
        denominator = (
            None
            if metric.denominator is None
            else np.array([[_value(r[p], metric.denominator) for p in self.prompts] for r in runs])
        )
        return numerator, denominator

    def seeds(self, key: tuple[float, str, str]) -> int:
        return len(self.settings.get(key, {}))

    def cut_short(self) -> tuple[int, int]:
        """(evaluation rollouts our infrastructure cut short, all of them): the former count as unanswered."""
        runs = [r for by_seed in self.settings.values() for r in by_seed.values()] + ([self.sft] if self.sft else [])
        finishes = [row.get("finish") for r in runs for row in r.values()]
        return sum(f == "infra_error" for f in finishes), len(finishes)


def _read_rows(path: Path) -> dict[str, dict]:
    return {row["prompt"]: row for _, row in iter_jsonl(path)}


def load_rows(study: StudyConfig) -> StudyRows:
    specs = plan(study)
    settings: dict[tuple[float, str, str], dict[int, dict[str, dict]]] = defaultdict(dict)
    for spec in specs:
        directory = run_dir(study, spec)
        if (directory / DONE).is_file():
            settings[(spec.outage_rate, spec.choice, spec.mode)][spec.seed] = _read_rows(directory / ROWS)
    sft_dir = run_dir(study, SFT_RUN)
    sft = _read_rows(sft_dir / ROWS) if (sft_dir / DONE).is_file() else None
    finished = [rows for runs in settings.values() for rows in runs.values()] + ([sft] if sft else [])
    if not finished:
        raise ValueError(f"{study.out}: no finished run (run `python -m osvl.study run` first)")
    prompts = sorted(finished[0])
    for rows in finished:
        if sorted(rows) != prompts:
            raise ValueError(f"{study.out}: runs were evaluated on different prompts ({len(rows)} vs {len(prompts)})")
    anchors = [finished[0][p].get("anchor") or p for p in prompts]
    clusters = anchors if len(set(anchors)) >= 2 else prompts
    return StudyRows(prompts, clusters, dict(settings), sft, sum(len(r) for r in settings.values()), len(specs))
