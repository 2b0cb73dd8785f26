"""scripts/copy_probe.py: document layout, the repeat-accuracy measure, and a few-step run."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from tests.trainer.fixtures import write_sft_data

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "copy_probe.py"
spec = importlib.util.spec_from_file_location("copy_probe", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_random_documents_repeat_their_segment_three_times():
    tokens, first = probe.random_document(
        random.Random(0), vocab=50, length=9, zipf=False, separator_every=3, separator=7
    )
    assert first == 9 and tokens == tokens[:9] * 3
    assert [tokens[i] for i in (2, 5, 8)] == [7, 7, 7]
    zipf, _ = probe.random_document(random.Random(0), vocab=50, length=3000, zipf=True, separator_every=0, separator=7)
    assert sum(t < 5 for t in zipf) > 3000 * 0.4  # the five most frequent of 50 ids carry half the mass


def test_repeat_accuracy_counts_only_the_repeated_tokens():
    docs = [([1, 2, 1, 2], 2), ([3, 4, 5, 3, 4, 5], 3)]
    ids = torch.tensor([1, 2, 1, 2, 3, 4, 5, 3, 4, 5])
    perfect = torch.nn.functional.one_hot(torch.roll(ids, -1), 8).float()
    assert probe.repeat_accuracy(perfect, ids, [0, 4], docs) == 1.0
    wrong = perfect.clone()
    wrong[[1, 2, 6, 7, 8], :] = torch.nn.functional.one_hot(torch.tensor(0), 8).float()  # the repeat rows
    assert probe.repeat_accuracy(wrong, ids, [0, 4], docs) == 0.0


def test_text_documents_mark_where_copies_start(tmp_path):
    tok_path, _ = write_sft_data(tmp_path / "tok")
    from osvl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tok_path)
    path = tmp_path / "lists.jsonl"
    path.write_text(json.dumps({"text": "List: Oslo Lyon\nRepeat: Oslo Lyon\nAgain: Oslo Lyon"}) + "\n")
    ((tokens, first),) = probe.text_documents(str(path), tokenizer, 10)
    assert tokens == tokenizer.encode("List: Oslo Lyon\nRepeat: Oslo Lyon\nAgain: Oslo Lyon")
    assert tokens[:first] == tokenizer.encode("List: Oslo Lyon\nRepeat:")
    path.write_text(json.dumps({"text": "no marker here"}) + "\n")
    with pytest.raises(ValueError, match="no '\\\\nRepeat:' marker"):
        probe.text_documents(str(path), tokenizer, 10)


def test_a_few_steps_report_both_kinds(tmp_path):
    tok_path, _ = write_sft_data(tmp_path / "tok")
    path = tmp_path / "lists.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"text": f"List: Oslo {c}\nRepeat: Oslo {c}\nAgain: Oslo {c}"}) for c in ("Lyon", "Graz", "Gent")
        )
        + "\n"
    )
    records = probe.main(
        [
            "--tokenizer",
            str(tok_path),
            "--source",
            "text",
            "--text",
            str(path),
            "--mix-random",
            "0.5",
            "--vocab",
            "100",
            "--length",
            "5",
            "--steps",
            "3",
            "--batch",
            "8",
            "--every",
            "1",
        ]
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0.0 <= r["repeat_acc_random"] <= 1.0 and 0.0 <= r["repeat_acc_text"] <= 1.0 for r in records)
    with pytest.raises(SystemExit):
        probe.main(["--tokenizer", str(tok_path), "--source", "text"])
    with pytest.raises(SystemExit):
        probe.main(["--tokenizer", str(tok_path), "--source", "random", "--vocab", "100000"])


@pytest.mark.slow
def test_the_demo_size_learns_to_copy_in_context(tmp_path):
    """The demo's policy must copy the names it reads; tied embeddings let the `small` preset form the
    induction circuit within a few hundred steps (untied it did not within 800: docs/demo.md)."""
    tok_path, _ = write_sft_data(tmp_path / "tok")
    argv = ["--tokenizer", str(tok_path), "--source", "random", "--vocab", "300", "--length", "20"]
    records = probe.main([*argv, "--steps", "400", "--every", "100", "--preset", "small"])
    # chance is 1/300; when the circuit forms varies with the CPU's float path (step ~100 to ~250 seen)
    assert max(r["repeat_acc_random"] for r in records[-2:]) > 0.8
