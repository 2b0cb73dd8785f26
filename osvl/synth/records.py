"""The record every curation stage reads and writes, and resumable JSONL stages over it.

A stage is a function ``QAItem -> QAItem | Drop``. :func:`run_stage` streams the input file,
skips inputs already decided (so an interrupted run resumes where it stopped), appends what
survives, logs what it drops, and writes ``<output>.counts.json`` with what each filter removed.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from osvl.jsonl import iter_jsonl, iter_records, write_jsonl
from osvl.synth.question import (
    Question,
    question_from_dict,
    question_to_dict,
    render_question,
)

T = TypeVar("T")


@dataclass
class QAItem:
    id: str
    path: list[str]  # v0 (anchor) .. vh (answer node)
    relations: list[str]
    attribute: str
    answer: str
    question: Question
    canonical: str = ""  # canonical question text (never a training target)
    aliases: list[str] = field(default_factory=list)  # accepted answer variants
    image: str | None = None  # question image, relative to the world root
    grounding_score: float | None = None
    degradation: dict[str, str] | None = None  # {"kind", "repair_tool", "image"}
    rewrite_log: list[dict[str, str]] = field(default_factory=list)

    @property
    def hops(self) -> int:
        return len(self.relations)

    @property
    def text(self) -> str:
        return render_question(self.question)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["question"] = question_to_dict(self.question)
        data["text"] = self.text
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QAItem:
        fields = {k: v for k, v in data.items() if k != "text"}
        try:
            fields["question"] = question_from_dict(fields["question"])
            return cls(**fields)
        except (KeyError, TypeError) as bad:
            raise ValueError(f"malformed QA item ({bad}): {str(data)[:200]}") from None


@dataclass(frozen=True)
class Drop:
    """A stage's decision to remove an item, with the filter that removed it."""

    reason: str


def read_items(path: str | os.PathLike[str]) -> Iterator[QAItem]:
    return iter_records(path, QAItem.from_dict)


def append_items(path: str | os.PathLike[str], items: Iterable[QAItem]) -> int:
    return write_jsonl(path, (item.to_dict() for item in items), append=True)


def counts_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{output}.counts.json")


def read_counts(output: str | os.PathLike[str]) -> dict[str, Any]:
    path = counts_path(output)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {"in": 0, "kept": 0, "dropped": {}}


def _write_counts(output: str | os.PathLike[str], counts: dict[str, Any]) -> None:
    path = counts_path(output)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(counts, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def drops_path(output: str | os.PathLike[str]) -> Path:
    return Path(f"{output}.drops.jsonl")


def run_stage(
    name: str,
    source: Iterable[T],
    output: str | os.PathLike[str],
    step: Callable[[T], QAItem | Drop],
    key: Callable[[T], str] = lambda item: item.id,
) -> dict[str, Any]:
    """Apply ``step`` to every input not yet decided; returns the stage's cumulative counts.

    Kept items are appended to ``output`` and drops to ``<output>.drops.jsonl`` (key and reason),
    one flushed line per decision, so an interrupted run resumes without repeating work or
    double-counting. A kept item's id must equal its input's key.
    """
    out, drops = Path(output), drops_path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch(exist_ok=True)
    kept = {item.id for item in read_items(out)}
    dropped: dict[str, str] = {}
    if drops.exists():
        for _, row in iter_jsonl(drops):
            dropped[row["key"]] = row["reason"]
    with (
        open(out, "a", encoding="utf-8", newline="\n") as kept_file,
        open(drops, "a", encoding="utf-8", newline="\n") as drop_file,
    ):
        for entry in source:
            entry_key = key(entry)
            if entry_key in kept or entry_key in dropped:
                continue
            result = step(entry)
            if isinstance(result, Drop):
                drop_file.write(json.dumps({"key": entry_key, "reason": result.reason}) + "\n")
                drop_file.flush()
                dropped[entry_key] = result.reason
            else:
                if result.id != entry_key:
                    raise ValueError(f"stage {name!r}: kept item id {result.id!r} differs from its key {entry_key!r}")
                kept_file.write(json.dumps(result.to_dict(), ensure_ascii=False, sort_keys=True) + "\n")
                kept_file.flush()
                kept.add(entry_key)
    counts = {
        "stage": name,
        "in": len(kept) + len(dropped),
        "kept": len(kept),
        "dropped": dict(sorted(Counter(dropped.values()).items())),
    }
    _write_counts(output, counts)
    return counts
