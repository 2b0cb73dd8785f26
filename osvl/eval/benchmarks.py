"""Benchmark file loaders: each benchmark's released JSONL fields -> :class:`EvalItem`.

A line that cannot become an item is a counted rejection with a reason (``invalid_json``,
``missing_question``, ``image_not_found``, ...), never an exception: one bad line must not lose
the other thousands. Fields are read from the JSONL export of each benchmark's released split
(the first key present wins; ``|`` lists alternatives):

| format | paper column | id | question | answers (reference, aliases) | image |
|---|---|---|---|---|---|
| ``simplevqa`` | SimpleVQA | ``data_id`` | ``question`` | ``answer`` | ``image`` |
| ``vdr`` | VDR | ``id`` \\| ``question_id`` | ``question`` | ``answer``, ``answers`` \\| ``aliases`` | ``image`` \\| ``images`` \\| ``image_path`` |
| ``mmsearch`` | MMSearch | ``sample_id`` | ``query`` | ``gt_answer``, ``alternative_gt_answers`` | ``query_image`` (optional: text-only queries exist) |
| ``livevqa`` | LiveVQA | ``id`` \\| ``sample_id`` | ``question`` \\| ``query`` | ``answer`` \\| ``gt`` | ``image`` \\| ``img_path`` \\| ``image_path`` |
| ``browsecomp_vl`` | BrowseComp-VL | ``id`` | ``question`` | ``answer`` | ``image`` \\| ``images`` |
| ``fvqa`` | FVQA | ``question_id`` \\| ``qa_id`` | ``question`` | ``answer`` | ``img_file`` \\| ``image`` |
| ``infoseek`` | InfoSeek | ``data_id`` | ``question`` | ``answer``, ``answer_eng`` | ``image_id`` -> ``<root>/<image_id>.jpg`` (or .JPEG/.jpeg/.png) |
| ``osvl`` | - | ``id`` | ``question`` | ``answer``, ``aliases`` | ``images``: SHA-256 names in ``images/`` (curated RL prompts) |

An image value may be a path (relative to the images root, by default the file's directory), a
``data:image/...;base64,`` URI, bare base64, a Hugging Face image dict ``{"bytes", "path"}``, or a
list of these. Remote URLs are rejected (``remote_image``): evaluation never downloads.
Answers may be strings, numbers or lists of them.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osvl.eval.items import EvalItem

MAX_EXAMPLES = 20  # rejection examples kept per file


@dataclass(frozen=True)
class BenchmarkFormat:
    """Where one benchmark keeps each field of an item."""

    name: str
    column: str | None  # the paper's Table 2 column, None when the paper has none
    id_keys: tuple[str, ...]
    question_keys: tuple[str, ...]
    answer_keys: tuple[str, ...]
    alias_keys: tuple[str, ...] = ()
    image_keys: tuple[str, ...] = ()
    image_id_key: str | None = None  # an id resolved to a file under the images root
    image_store: bool = False  # images are SHA-256 names in ``images/`` beside the file
    requires_image: bool = True
    meta_keys: tuple[str, ...] = ()


FORMATS: dict[str, BenchmarkFormat] = {f.name: f for f in (
    BenchmarkFormat("simplevqa", "SimpleVQA", ("data_id",), ("question",), ("answer",),
                    image_keys=("image",), meta_keys=("language", "vqa_category")),
    BenchmarkFormat("vdr", "VDR", ("id", "question_id"), ("question",), ("answer",), ("answers", "aliases"),
                    image_keys=("image", "images", "image_path")),
    BenchmarkFormat("mmsearch", "MMSearch", ("sample_id",), ("query",), ("gt_answer",),
                    ("alternative_gt_answers",), image_keys=("query_image",), requires_image=False,
                    meta_keys=("area", "subfield")),
    BenchmarkFormat("livevqa", "LiveVQA", ("id", "sample_id"), ("question", "query"), ("answer", "gt"),
                    image_keys=("image", "img_path", "image_path")),
    BenchmarkFormat("browsecomp_vl", "BrowseComp-VL", ("id",), ("question",), ("answer",),
                    image_keys=("image", "images"), meta_keys=("level",)),
    BenchmarkFormat("fvqa", "FVQA", ("question_id", "qa_id"), ("question",), ("answer",),
                    image_keys=("img_file", "image"), meta_keys=("kb_source",)),
    BenchmarkFormat("infoseek", "InfoSeek", ("data_id",), ("question",), ("answer",), ("answer_eng",),
                    image_id_key="image_id", meta_keys=("data_split",)),
    BenchmarkFormat("osvl", None, ("id",), ("question",), ("answer",), ("aliases",),
                    image_keys=("images",), image_store=True),
)}
IMAGE_ID_SUFFIXES = (".jpg", ".JPEG", ".jpeg", ".png")


class Rejected(ValueError):
    """One line that cannot become an item; ``reason`` is the counted key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class LoadReport:
    """What a benchmark file yielded: the items, and every rejected line counted by reason."""

    benchmark: str
    path: str
    items: list[EvalItem] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # "line N: reason: detail"

    def reject(self, line: int, error: Rejected) -> None:
        self.rejected[error.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"line {line}: {error}")

    def to_dict(self) -> dict[str, Any]:
        return {"benchmark": self.benchmark, "path": self.path, "items": len(self.items),
                "rejected": dict(sorted(self.rejected.items())), "examples": list(self.examples)}


def get_format(name: str) -> BenchmarkFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark format {name!r}; known: {', '.join(FORMATS)}") from None


def _first(row: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = row.get(key)
        if value is not None and value != "" and value != []:
            return value
    return None


def _texts(value: Any, what: str) -> list[str]:
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise Rejected(f"{what}_not_text", f"got {type(v).__name__}")
        text = str(v).strip()
        if text:
            out.append(text)
    return out


def _looks_base64(text: str) -> bool:
    if len(text) < 64 or any(c.isspace() for c in text.strip()):
        return False
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _image_ref(value: Any, root: Path) -> str:
    if isinstance(value, Mapping):  # Hugging Face Image feature: {"bytes": ..., "path": ...}
        if isinstance(value.get("bytes"), str) and value["bytes"]:
            return _image_ref(value["bytes"] if value["bytes"].startswith("data:")
                              else "data:image;base64," + value["bytes"], root)
        if isinstance(value.get("path"), str) and value["path"]:
            return _image_ref(value["path"], root)
        raise Rejected("image_not_text", "image dict without 'bytes' or 'path'")
    if not isinstance(value, str) or not value.strip():
        raise Rejected("image_not_text", f"got {type(value).__name__}")
    value = value.strip()
    if value.startswith("data:"):
        return value
    if value.startswith(("http://", "https://")):
        raise Rejected("remote_image", f"{value[:80]} (download the benchmark's images first)")
    path = root / value
    if path.is_file():
        return str(path.resolve())
    if _looks_base64(value):
        return "data:image;base64," + value
    raise Rejected("image_not_found", str(path))


def _image_refs(row: Mapping[str, Any], fmt: BenchmarkFormat, root: Path, store: Path) -> list[str]:
    if fmt.image_id_key is not None:
        image_id = row.get(fmt.image_id_key)
        if image_id is None or image_id == "":
            return []
        for suffix in IMAGE_ID_SUFFIXES:
            path = root / f"{image_id}{suffix}"
            if path.is_file():
                return [str(path.resolve())]
        raise Rejected("image_not_found", f"{root / str(image_id)}{{{','.join(IMAGE_ID_SUFFIXES)}}}")
    value = _first(row, fmt.image_keys)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if fmt.image_store:
        names = [f"{v}.png" if isinstance(v, str) else v for v in values]
        return [_image_ref(n, store) for n in names]
    return [_image_ref(v, root) for v in values]


def convert(row: Any, fmt: BenchmarkFormat, root: Path, store: Path) -> EvalItem:
    """One parsed JSON line -> an item, or :class:`Rejected` with the reason."""
    if not isinstance(row, Mapping):
        raise Rejected("not_an_object", f"line holds a JSON {type(row).__name__}")
    item_id = _first(row, fmt.id_keys)
    if item_id is None:
        raise Rejected("missing_id", f"none of {list(fmt.id_keys)}")
    question = _first(row, fmt.question_keys)
    if not isinstance(question, str) or not question.strip():
        raise Rejected("missing_question", f"none of {list(fmt.question_keys)} holds text")
    answer = _first(row, fmt.answer_keys)
    if answer is None:
        raise Rejected("missing_answer", f"none of {list(fmt.answer_keys)}")
    answers = _texts(answer, "answer")
    aliases = _first(row, fmt.alias_keys)
    if aliases is not None:
        answers += [a for a in _texts(aliases, "alias") if a not in answers]
    if not answers:
        raise Rejected("missing_answer", "answers are empty")
    images = _image_refs(row, fmt, root, store)
    if fmt.requires_image and not images:
        raise Rejected("missing_image", f"none of {list(fmt.image_keys or [fmt.image_id_key])}")
    meta = {k: str(row[k]) for k in fmt.meta_keys if row.get(k) is not None}
    return EvalItem(benchmark=fmt.name, id=str(item_id), question=question.strip(), answers=tuple(answers),
                    images=tuple(images), meta=meta)


def load_benchmark(path: str | os.PathLike[str], fmt: BenchmarkFormat | str,
                   images_root: str | os.PathLike[str] | None = None, name: str | None = None) -> LoadReport:
    """All items of a JSONL file; ``name`` relabels the items (default: the format's name)."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"benchmark file not found: {path}")
    root = Path(images_root) if images_root is not None else path.parent
    store = path.parent / "images"
    label = name or fmt.name
    report = LoadReport(benchmark=label, path=str(path))
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                try:
                    row = json.loads(line)
                except ValueError as error:
                    raise Rejected("invalid_json", str(error)) from None
                item = convert(row, fmt, root, store)
                if item.id in seen:
                    raise Rejected("duplicate_id", item.id)
            except Rejected as error:
                report.reject(number, error)
                continue
            seen.add(item.id)
            report.items.append(item if label == fmt.name else EvalItem(
                benchmark=label, id=item.id, question=item.question, answers=item.answers,
                images=item.images, meta=item.meta))
    return report
