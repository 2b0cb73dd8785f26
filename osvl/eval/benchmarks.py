"""Benchmark file loaders: each benchmark's released fields -> :class:`EvalItem`.

A record that cannot become an item is a counted rejection with a reason (``invalid_json``,
``missing_question``, ``image_not_found``, ...), never an exception: one bad record must not lose
the other thousands. A file is JSONL (one record a line), one JSON array of records (LiveVQA's
``benchmark.json``) or parquet (one record a row). The first key present wins
(``|`` lists alternatives); "verified" names the public source the layout was checked against:

| format | id | question | answers (reference, aliases) | image | source |
|---|---|---|---|---|---|
| ``simplevqa`` | ``data_id`` | ``question`` | ``answer`` | ``image`` (``{"bytes", "path"}`` in the parquet) | verified: SimpleVQA dataset cards (m-a-p/SimpleVQA; its parquet mirror lists ``data_id`` int64, ``image``, ``question``, ``answer``, ``language``, ``vqa_category``, 2,024 test rows) |
| ``vdr`` | ``id`` \\| ``question_id`` | ``question`` | ``answer``, ``answers`` \\| ``aliases`` | ``image`` (encoded bytes in the parquet) \\| ``images`` \\| ``image_path`` | verified: shawn0728/OpenSearch-VL opensearch_vl/eval_with_gpt4o.py reads VDR-Bench-testmini parquet by ``id``/``answer``; a public VDR-Bench converter reads ``vision-deepresearch_VDR-Bench-full.parquet`` as ``id``, ``question``, ``answer``, ``image`` bytes |
| ``mmsearch`` | ``sample_id`` | ``query`` | ``gt_answer``, ``alternative_gt_answers`` | ``query_image`` (None for text-only queries) | verified: CaraJ7/MMSearch eval_end2end.py (CaraJ/MMSearch ``end2end``) |
| ``livevqa`` | ``id`` + ``/level1_qa`` \\| ``/level2_qa`` | ``question`` | ``Ground_Truth_List`` | ``img_path`` | verified: fumingyang2004/LIVEVQA liveVQA_benchmarks/News/benchmark.json (a JSON array; each record holds two QA levels) |
| ``browsecomp_vl`` | ``id`` \\| ``data_id``, else the line number | ``question`` | ``answers`` \\| ``answer`` | ``image_path`` \\| ``image`` \\| ``images`` (relative; the file name alone is tried under the root too) | partly verified: a public BrowseComp-VL converter reads the WebWatcher release as ``bc_vl_level1.jsonl`` / ``bc_vl_level2.jsonl`` lines with ``question``, ``answers`` (list), ``image_path``, ``domain`` and no id field; the Alibaba-NLP/WebAgent files themselves are not in the index |
| ``fvqa`` | ``data_id`` \\| ``question_id`` \\| ``qa_id`` | ``question``, else the user turn of ``prompt`` (``<image>`` removed) | ``answer`` \\| ``reward_model.ground_truth``, ``candidate_answers`` \\| ``reward_model.candidate_answers`` | ``images`` (``{"bytes", "path"}`` list) \\| ``img_file`` \\| ``image`` | verified: lmms-lab/FVQA ``fvqa_test.parquet`` is verl-style (``data_id``, ``prompt``, ``images``, ``reward_model`` {``ground_truth``, ``candidate_answers``}, ``category``, ``data_source``): OpenSearch-VL opensearch_infer/pipeline.py and a public FVQA converter read it so; the flat ``question``/``answer`` layout is the converters' JSONL |
| ``infoseek`` | ``data_id`` | ``question`` | ``answer``, ``answer_eval`` \\| ``answer_eng`` | ``image_id`` -> ``<root>/<image_id>.jpg`` (or .JPEG/.jpeg/.png) | verified: open-vision-language/infoseek README, edchengg/infoseek_eval infoseek_eval.py (numeric ``answer_eval`` is ``[{"wikidata": x, "range": [lo, hi]}]``); ``answer_eng`` unverified |
| ``osvl`` | ``id`` | ``question`` | ``answer``, ``aliases`` | ``images``: SHA-256 names in ``images/`` (curated RL prompts) | this repo |

The official OpenSearch-VL release ships no eval data of its own: its runner reads the benchmarks'
own parquet files (FVQA, VDR-Bench testmini) and BrowseComp-VL trajectories, so the loaders above
are the release's inputs too. A key ``a.b`` reads field ``b`` of struct ``a`` (a JSON string
holding an object counts as one). ``.parquet`` files are read directly, in batches.

An image value may be a path (relative to the images root, by default the file's directory), a
``data:image/...;base64,`` URI, bare base64, encoded bytes (parquet), a Hugging Face image dict
``{"bytes", "path"}``, or a list of these. Remote URLs are rejected (``remote_image``): evaluation never downloads.
Answers may be strings, numbers or lists of them; an InfoSeek numeric alias contributes its
``wikidata`` value.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping
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
    sub_item_keys: tuple[str, ...] = ()  # nested question records, each one item (LiveVQA levels)
    id_from_line: bool = False  # records without an id are named by their line (BrowseComp-VL)


FORMATS: dict[str, BenchmarkFormat] = {
    f.name: f
    for f in (
        BenchmarkFormat(
            "simplevqa",
            "SimpleVQA",
            ("data_id",),
            ("question",),
            ("answer",),
            image_keys=("image",),
            meta_keys=("language", "vqa_category"),
        ),
        BenchmarkFormat(
            "vdr",
            "VDR",
            ("id", "question_id"),
            ("question",),
            ("answer",),
            ("answers", "aliases"),
            image_keys=("image", "images", "image_path"),
        ),
        BenchmarkFormat(
            "mmsearch",
            "MMSearch",
            ("sample_id",),
            ("query",),
            ("gt_answer",),
            ("alternative_gt_answers",),
            image_keys=("query_image",),
            requires_image=False,
            meta_keys=("area", "subfield"),
        ),
        BenchmarkFormat(
            "livevqa",
            "LiveVQA",
            ("id",),
            ("question",),
            ("Ground_Truth_List",),
            image_keys=("img_path",),
            meta_keys=("question_type", "source", "time"),
            sub_item_keys=("level1_qa", "level2_qa"),
        ),
        BenchmarkFormat(
            "browsecomp_vl",
            "BrowseComp-VL",
            ("id", "data_id"),
            ("question",),
            ("answers", "answer"),
            image_keys=("image_path", "image", "images"),
            meta_keys=("domain", "level"),
            id_from_line=True,
        ),
        BenchmarkFormat(
            "fvqa",
            "FVQA",
            ("data_id", "question_id", "qa_id"),
            ("question", "prompt"),
            ("answer", "reward_model.ground_truth"),
            ("candidate_answers", "reward_model.candidate_answers"),
            image_keys=("images", "img_file", "image"),
            meta_keys=("category", "data_source"),
        ),
        BenchmarkFormat(
            "infoseek",
            "InfoSeek",
            ("data_id",),
            ("question",),
            ("answer",),
            ("answer_eval", "answer_eng"),
            image_id_key="image_id",
            meta_keys=("data_split",),
        ),
        BenchmarkFormat(
            "osvl", None, ("id",), ("question",), ("answer",), ("aliases",), image_keys=("images",), image_store=True
        ),
    )
}
IMAGE_ID_SUFFIXES = (".jpg", ".JPEG", ".jpeg", ".png")
IMAGE_PLACEHOLDER = "<image>"
PARQUET_BATCH_ROWS = 256


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
        return {
            "benchmark": self.benchmark,
            "path": self.path,
            "items": len(self.items),
            "rejected": dict(sorted(self.rejected.items())),
            "examples": list(self.examples),
        }


def get_format(name: str) -> BenchmarkFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark format {name!r}; known: {', '.join(FORMATS)}") from None


def _get(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``; ``a.b`` reads ``b`` of struct ``a`` (exports often store structs as JSON text)."""
    value: Any = row
    for part in key.split("."):
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _first(row: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = _get(row, key)
        if value is not None and value != "" and value != [] and value != b"":
            return value
    return None


def _question_text(value: Any) -> str | None:
    """A question string, or the last user turn of verl-style chat messages without image placeholders."""
    if isinstance(value, list):
        users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        value = users[-1] if users else None
        if isinstance(value, list):  # OpenAI content parts
            value = " ".join(p["text"] for p in value if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    if not isinstance(value, str):
        return None
    text = value.replace(IMAGE_PLACEHOLDER, "").strip()
    return text or None


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


def _alias_texts(value: Any) -> list[str]:
    """InfoSeek's numeric aliases are ``{"wikidata": x, "range": [lo, hi]}``: the value is the alias."""
    values = value if isinstance(value, list) else [value]
    plain = [v["wikidata"] if isinstance(v, Mapping) and "wikidata" in v else v for v in values]
    return _texts(plain, "alias")


def _looks_base64(text: str) -> bool:
    if len(text) < 64 or any(c.isspace() for c in text.strip()):
        return False
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _image_ref(value: Any, root: Path) -> str:
    if isinstance(value, (bytes, bytearray)):  # parquet binary column
        if not value:
            raise Rejected("image_not_text", "empty image bytes")
        return "data:image;base64," + base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):  # Hugging Face Image feature: {"bytes": ..., "path": ...}
        if isinstance(value.get("bytes"), (bytes, bytearray)) and value["bytes"]:
            return _image_ref(value["bytes"], root)
        if isinstance(value.get("bytes"), str) and value["bytes"]:
            return _image_ref(
                value["bytes"] if value["bytes"].startswith("data:") else "data:image;base64," + value["bytes"], root
            )
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
    if (root / path.name).is_file():  # a release path such as "images/x.jpg" with the root at the images
        return str((root / path.name).resolve())
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


def convert(row: Any, fmt: BenchmarkFormat, root: Path, store: Path, line: int | None = None) -> EvalItem:
    """One parsed record -> an item, or :class:`Rejected` with the reason; ``line`` names id-less records."""
    if not isinstance(row, Mapping):
        raise Rejected("not_an_object", f"line holds a JSON {type(row).__name__}")
    item_id = _first(row, fmt.id_keys)
    if item_id is None and fmt.id_from_line and line is not None:
        item_id = str(line)
    if item_id is None:
        raise Rejected("missing_id", f"none of {list(fmt.id_keys)}")
    question = _question_text(_first(row, fmt.question_keys))
    if question is None:
        raise Rejected("missing_question", f"none of {list(fmt.question_keys)} holds text")
    answer = _first(row, fmt.answer_keys)
    if answer is None:
        raise Rejected("missing_answer", f"none of {list(fmt.answer_keys)}")
    answers = _texts(answer, "answer")
    aliases = _first(row, fmt.alias_keys)
    if aliases is not None:
        answers += [a for a in _alias_texts(aliases) if a not in answers]
    if not answers:
        raise Rejected("missing_answer", "answers are empty")
    images = _image_refs(row, fmt, root, store)
    if fmt.requires_image and not images:
        raise Rejected("missing_image", f"none of {list(fmt.image_keys or [fmt.image_id_key])}")
    meta = {k: str(row[k]) for k in fmt.meta_keys if row.get(k) is not None}
    return EvalItem(
        benchmark=fmt.name, id=str(item_id), question=question, answers=tuple(answers), images=tuple(images), meta=meta
    )


def convert_all(row: Any, fmt: BenchmarkFormat, root: Path, store: Path, line: int | None = None) -> list[EvalItem]:
    """One record -> its items; a format with ``sub_item_keys`` yields one item per nested record."""
    if not fmt.sub_item_keys:
        return [convert(row, fmt, root, store, line)]
    if not isinstance(row, Mapping):
        raise Rejected("not_an_object", f"record is a JSON {type(row).__name__}")
    parent_id = _first(row, fmt.id_keys)
    if parent_id is None:
        raise Rejected("missing_id", f"none of {list(fmt.id_keys)}")
    subs = [(key, row[key]) for key in fmt.sub_item_keys if isinstance(row.get(key), Mapping)]
    if not subs:
        raise Rejected("missing_question", f"none of {list(fmt.sub_item_keys)} holds a question record")
    inherited = {k: v for k, v in row.items() if k not in fmt.sub_item_keys}
    return [convert({**inherited, **sub, fmt.id_keys[0]: f"{parent_id}/{key}"}, fmt, root, store) for key, sub in subs]


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number from 1, row as a dict), a batch of rows in memory at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        number = 0
        for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                number += 1
                yield number, row
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"cannot read parquet file {path}: {error}") from None


def _records(handle: Any) -> Iterator[tuple[int, Any]]:
    """(number, parsed record or :class:`Rejected`) from JSONL, or from one JSON array of records."""
    text = handle.read()
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError:
            records = None  # JSONL whose first record is an array: counted line by line below
        if isinstance(records, list):
            yield from enumerate(records, start=1)
            return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError as error:
            yield number, Rejected("invalid_json", str(error))


def load_benchmark(
    path: str | os.PathLike[str],
    fmt: BenchmarkFormat | str,
    images_root: str | os.PathLike[str] | None = None,
    name: str | None = None,
) -> LoadReport:
    """All items of a JSONL, JSON-array or parquet file; ``name`` relabels the items (default: the format's name)."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"benchmark file not found: {path}")
    root = Path(images_root) if images_root is not None else path.parent
    store = path.parent / "images"
    label = name or fmt.name
    report = LoadReport(benchmark=label, path=str(path))
    seen: set[str] = set()
    with contextlib.ExitStack() as stack:
        if path.suffix == ".parquet":
            records = _parquet_records(path)
        else:
            records = _records(stack.enter_context(open(path, encoding="utf-8", errors="replace")))
        for number, row in records:
            try:
                if isinstance(row, Rejected):
                    raise row
                items = convert_all(row, fmt, root, store, number)
                for item in items:
                    if item.id in seen:
                        raise Rejected("duplicate_id", item.id)
            except Rejected as error:
                report.reject(number, error)
                continue
            for item in items:
                seen.add(item.id)
                report.items.append(
                    item
                    if label == fmt.name
                    else EvalItem(
                        benchmark=label,
                        id=item.id,
                        question=item.question,
                        answers=item.answers,
                        images=item.images,
                        meta=item.meta,
                    )
                )
    return report
