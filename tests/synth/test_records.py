"""QA item records and the resumable stage runner."""

from __future__ import annotations

import json

import numpy as np
import pytest

from osvl.rl.trajectory import Prompt, read_prompts, write_prompts
from osvl.synth.question import Mention, Question, Rel
from osvl.synth.records import (
    Drop,
    QAItem,
    append_items,
    read_counts,
    read_items,
    run_stage,
)


def _item(i: int) -> QAItem:
    question = Question((Mention(name="A"), Mention(noun="person", constraints=(Rel("spouse", 0),))), "born")
    return QAItem(
        id=f"item{i}", path=["A", "B"], relations=["spouse"], attribute="born", answer=str(1900 + i), question=question
    )


def test_items_round_trip(tmp_path):
    path = tmp_path / "items.jsonl"
    append_items(path, [_item(0), _item(1)])
    assert list(read_items(path)) == [_item(0), _item(1)]
    assert json.loads(path.read_text().splitlines()[0])["text"] == "What is the born of the spouse of A?"


def test_bad_item_lines_name_their_line(tmp_path):
    path = tmp_path / "items.jsonl"
    append_items(path, [_item(0)])
    with open(path, "a") as handle:
        handle.write(json.dumps({"id": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"items.jsonl:2: malformed QA item"):
        list(read_items(path))


def test_stage_counts_and_resumes_after_a_crash(tmp_path):
    out = tmp_path / "stage.jsonl"
    calls = []

    def flaky(item):
        calls.append(item.id)
        if item.id == "item3" and calls.count("item3") == 1:
            raise RuntimeError("worker died")
        return Drop("odd") if int(item.id[-1]) % 2 else item

    items = [_item(i) for i in range(6)]
    with pytest.raises(RuntimeError):
        run_stage("demo", items, out, flaky)
    assert [i.id for i in read_items(out)] == ["item0", "item2"]
    counts = run_stage("demo", items, out, flaky)
    assert counts == {"stage": "demo", "in": 6, "kept": 3, "dropped": {"odd": 3}}
    assert calls == ["item0", "item1", "item2", "item3", "item3", "item4", "item5"]  # nothing redone
    assert [i.id for i in read_items(out)] == ["item0", "item2", "item4"]
    assert run_stage("demo", items, out, flaky) == counts and len(calls) == 7


def test_stage_over_no_input_still_writes_its_files(tmp_path):
    counts = run_stage("empty", [], tmp_path / "e.jsonl", lambda item: item)
    assert counts == {"stage": "empty", "in": 0, "kept": 0, "dropped": {}}
    assert (tmp_path / "e.jsonl").exists() and read_counts(tmp_path / "e.jsonl")["in"] == 0


def test_prompts_round_trip_with_images(tmp_path):
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    path = tmp_path / "rl" / "prompts.jsonl"
    write_prompts(path, [Prompt(id="p", question="q?", images=[image], answer="a", aliases=["b"])])
    (back,) = read_prompts(path)
    assert back.id == "p" and back.aliases == ["b"] and np.array_equal(back.images[0], image)


def test_a_kept_item_must_keep_its_key(tmp_path):
    with pytest.raises(ValueError, match="differs from its key"):
        run_stage("bad", ["seed"], tmp_path / "x.jsonl", lambda seed: _item(0), key=lambda seed: seed)
