"""Plain-text continued pretraining through the SFT stage: ``data.format = "text"``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from osvl.config import load_recipe
from osvl.config.recipe import DataConfig
from osvl.data.formats import FileStats, detect_format, iter_text, text_windows
from osvl.data.packing import text_sequence
from osvl.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from osvl.model import read_hf_tensors, save_pretrained
from osvl.trainer import read_metrics, run_sft
from osvl.trainer.policy import build_policy, policy_arch, policy_renderer
from osvl.trainer.sft_data import load_sft_sequences

DOCS = [
    f"[Passage 1] Bridge {i}\nSummary: Its length in metres is {100 + 7 * i}.\n\nQ: What is the length in metres "
    f"of Bridge {i}?\nA: {100 + 7 * i}"
    for i in range(12)
]
QUIET = ["metrics.console=false", "metrics.tensorboard=false", "checkpoint.every_steps=0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    train_bpe_tokenizer(DOCS * 3, vocab_size=320).save(root / "tokenizer.json")
    path = root / "text.jsonl"
    rows = [{"text": d} for d in DOCS] + [{"text": ""}, {"text": 3}, ["not", "an", "object"]]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root / "tokenizer.json", path


def test_reader_keeps_documents_and_counts_the_rest(corpus):
    _, path = corpus
    stats = FileStats(str(path))
    assert list(iter_text(path, stats)) == DOCS
    assert stats.records == len(DOCS) and stats.rejected == {"no text": 3}
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_text(path.parent / "missing.jsonl"))


def test_windows_cover_the_document_and_end_with_endoftext(corpus):
    tok_path, _ = corpus
    tokenizer = load_tokenizer(tok_path)
    ids = tokenizer.encode(DOCS[0]) + [tokenizer.special.endoftext]
    whole = text_windows(DOCS[0], tokenizer, 4096)
    assert len(whole) == 1 and whole[0].tolist() == ids
    cut = text_windows(DOCS[0], tokenizer, 7)
    assert np.concatenate(cut).tolist()[: len(ids) - len(ids) % 7 or len(ids)] == ids[: len(np.concatenate(cut))]
    assert all(2 <= len(w) <= 7 for w in cut) and sum(map(len, cut)) >= len(ids) - 1
    with pytest.raises(ValueError, match="max_tokens must be >= 2"):
        text_windows(DOCS[0], tokenizer, 1)


def test_text_sequence_puts_loss_on_every_predicted_token():
    seq = text_sequence(np.arange(5), group_id=3)
    assert seq.loss_mask.tolist() == [False, True, True, True, True] and seq.num_valid_tokens == 4
    assert seq.images == [] and seq.group_id == 3 and seq.reward == 0.0


def test_format_is_detected_and_only_sft_reads_it(corpus, tmp_path):
    tok_path, path = corpus
    assert detect_format(path) == "text"
    with pytest.raises(ValueError, match="the grpo stage reads"):
        load_recipe("tiny_grpo", ["data.format=text"])
    recipe = load_recipe("tiny_sft", [f"data.tokenizer={tok_path}", f"data.train_path={path}"])
    tokenizer = load_tokenizer(tok_path)
    renderer = policy_renderer(recipe, tokenizer, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special))
    sequences = load_sft_sequences(DataConfig(train_path=str(path), max_tokens=4096), renderer)
    assert [s.input_ids.tolist() for s in sequences] == [text_windows(d, tokenizer, 4096)[0].tolist() for d in DOCS]
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": " "}) + "\n")
    with pytest.raises(ValueError, match="holds no usable text"):
        load_sft_sequences(DataConfig(train_path=str(empty), format="text"), renderer)


def test_sft_stage_pretrains_on_text(corpus, tmp_path):
    tok_path, path = corpus
    recipe = load_recipe(
        "tiny_base",
        [
            f"data.tokenizer={tok_path}",
            f"data.train_path={path}",
            f"job.run_dir={tmp_path / 'run'}",
            "sft.global_batch=4",
            "sft.epochs=2",
            "metrics.log_every=1",
            *QUIET,
        ],
    )
    tokenizer = load_tokenizer(tok_path)
    save_pretrained(
        build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1),
        tmp_path / "init",
        dtype=torch.float32,
    )
    result = run_sft(recipe)
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert result.steps == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    initial = read_hf_tensors(tmp_path / "init")
    trained = read_hf_tensors(tmp_path / "run" / "hf")
    changed = {k for k in trained if not torch.equal(trained[k], initial[k])}
    assert any(k.startswith("model.language_model") for k in changed)
    assert (tmp_path / "run" / "hf" / "tokenizer.json").is_file()
