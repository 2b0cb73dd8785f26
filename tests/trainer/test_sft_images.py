"""SFT on osvl JSONL with images: every rank lays out every sequence's tokens from image headers, and
makes pixels only for what it packs; the packed batches are the eager path's, bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from osvl.data.chat import ChatRenderer
from osvl.data.formats import tokenize_steps
from osvl.data.image_files import ImageFileCache
from osvl.data.packing import train_sequence
from osvl.data.tokenizer import load_tokenizer
from osvl.rl.trajectory import read_jsonl
from osvl.trainer.sft_data import load_sft_sequences
from tests.trainer.ranks import run_ranks, sft_packing_body
from tests.trainer.sft_images import IMAGE_CONFIG, rendered_image_files, write_image_sft_data

N = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_images")
    return root, write_image_sft_data(root, N)


def test_two_ranks_pack_the_eager_batches_and_decode_only_their_share(corpus):
    root, data = corpus
    longest = max(
        s.num_tokens
        for s in load_sft_sequences(data, ChatRenderer(load_tokenizer(root / "tokenizer.json"), IMAGE_CONFIG))
    )
    run_ranks(sft_packing_body, 2, str(root), 2 * longest, 8)  # 4 sequences a rank in 2+ micro-batches
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(ranks[0]["packed"] + ranks[1]["packed"]) == list(range(N))  # one epoch: each line packed once
    every_file = rendered_image_files(data, set(range(N)))
    assert set(ranks[0]["files"]) | set(ranks[1]["files"]) == every_file
    assert all(len(r["files"]) < len(every_file) for r in ranks)  # the other rank's unique images stay files


def test_sequences_match_the_eager_render_and_each_file_is_decoded_once(corpus):
    root, data = corpus
    tokenizer = load_tokenizer(root / "tokenizer.json")
    renderer, cache = ChatRenderer(tokenizer, IMAGE_CONFIG), ImageFileCache()
    deferred = load_sft_sequences(data, renderer, image_cache=cache)
    eager = [
        train_sequence(tokenize_steps(t, tokenizer, keep_token_ids=True), renderer, reward=0.0)
        for t in read_jsonl(data)
    ]
    every_file = rendered_image_files(data, set(range(N)))
    assert cache.num_files == len(every_file) + 1 and cache.num_decoded == 0  # + the unrendered last observation
    for new, old in zip(deferred, eager, strict=True):
        for name in ("input_ids", "loss_mask", "token_step", "logprobs"):
            assert np.array_equal(getattr(new, name), getattr(old, name)), name
        assert [i.grid_thw for i in new.images] == [i.grid_thw for i in old.images]
        assert all(np.array_equal(a.pixels, b.pixels) for a, b in zip(new.images, old.images, strict=True))
    assert cache.num_decoded == len(every_file) < sum(len(s.images) for s in deferred)
    assert deferred[7].logprobs.min() == np.float32(-0.25)  # the recorded line kept its engine values


def test_bad_records_name_their_line(tmp_path, corpus):
    root, data = corpus
    renderer = ChatRenderer(load_tokenizer(root / "tokenizer.json"), IMAGE_CONFIG)
    lines = data.read_text().splitlines()
    bad = tmp_path / "sft.jsonl"
    (tmp_path / "images").symlink_to(data.parent / "images")
    record = json.loads(lines[2])
    record["prompt"]["images"] = ["0" * 64]
    bad.write_text("\n".join([lines[0], json.dumps(record)]) + "\n")
    with pytest.raises(ValueError, match=rf"sft\.jsonl:2: image .*{'0' * 64}\.png: not a readable image"):
        load_sft_sequences(bad, renderer)
    del record["steps"]
    bad.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"sft\.jsonl:1: the record has no 'steps' field"):
        load_sft_sequences(bad, renderer)
    bad.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"sft\.jsonl:1: expected a trajectory object"):
        load_sft_sequences(bad, renderer)
