"""Tokenizer loading (Qwen3-VL layout), tiny BPE training, special-token ids by name."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from osvl.data.tokenizer import (
    QWEN_ADDED_TOKENS,
    CachedTokenizer,
    SpecialTokens,
    Tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)
from tests.data.helpers import CORPUS, tiny_tokenizer

QWEN_BASE_VOCAB = 151643  # Qwen2/3 learned vocabulary size; added tokens start here


def qwen_layout_backend() -> Backend:
    """A byte-level BPE padded to Qwen's vocabulary size, with Qwen's added tokens after it."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(alphabet)}
    vocab.update({f"<filler_{i}>": i for i in range(len(alphabet), QWEN_BASE_VOCAB)})
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    for token, special in QWEN_ADDED_TOKENS:
        add = backend.add_special_tokens if special else backend.add_tokens
        add([AddedToken(token, special=special, normalized=False)])
    return backend


def test_qwen_tokenizer_json_gives_qwen_ids(tmp_path):
    qwen_layout_backend().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)  # a checkpoint directory
    s = tok.special
    assert (s.image_pad, s.vision_start, s.vision_end) == (151655, 151652, 151653)
    assert (s.im_start, s.im_end, s.endoftext) == (151644, 151645, 151643)
    assert (s.tool_call_start, s.tool_call_end, s.think_start, s.think_end) == (151657, 151658, 151667, 151668)
    assert (s.tool_response_start, s.tool_response_end) == (151665, 151666)
    ids = tok.encode("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>")
    assert ids[0] == 151644 and ids[6:9] == [151652, 151655, 151653] and ids[-1] == 151645  # "user\n" is 5 bytes
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("abc") == tok.encode("abc")


def test_trained_tokenizer_has_qwen_layout_after_its_vocab():
    tok = tiny_tokenizer()
    ids = [tok.backend.token_to_id(token) for token, _ in QWEN_ADDED_TOKENS]
    first = ids[0]
    assert ids == list(range(first, first + len(QWEN_ADDED_TOKENS)))
    assert first + len(QWEN_ADDED_TOKENS) == tok.vocab_size <= 1024
    assert tok.special.image_pad == first + 12 and tok.special.think_end == tok.vocab_size - 1
    # merges were learned: frequent words take fewer tokens than bytes
    assert len(tok.encode(" search")) < len(b" search")


def test_number_pieces_are_one_id_each_and_round_trip(tmp_path):
    qwen = train_bpe_tokenizer(CORPUS, 400)
    paired = train_bpe_tokenizer(CORPUS, 400, max_digits=2)
    text = "Its population is 254000; born 17 April 1937, 151 cm."
    pieces = [paired.decode([i]) for i in paired.encode(text)]
    assert {"25", "40", "00", "17", "19", "37", "15", "1"} <= set(pieces) and "254000" not in pieces
    assert not any(p.isdigit() and len(p) > 1 for p in (qwen.decode([i]) for i in qwen.encode(text)))
    assert paired.decode(paired.encode(text)) == text and paired.vocab_size >= qwen.vocab_size + 90
    assert paired.special == qwen.special  # Qwen's added tokens keep their ids; the pieces come after
    paired.save(tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).encode(text) == paired.encode(text)
    triple = train_bpe_tokenizer(CORPUS, 400, max_digits=3)
    assert [triple.decode([i]) for i in triple.encode("254000 1937")] == ["254", "000", " ", "193", "7"]


def test_whole_words_are_one_id_wherever_they_stand(tmp_path):
    names = ["Danquen Isdan", "Osar", "Vase of Noryarnor"]
    tok = train_bpe_tokenizer(CORPUS, 400, max_digits=2, whole_words=names)
    plain = train_bpe_tokenizer(CORPUS, 400, max_digits=2)
    ids = {name: tok.encode(name) for name in names}
    assert all(len(i) == 1 for i in ids.values()) and len(set(map(tuple, ids.values()))) == 3
    # the same id in a passage (after a space) and in a JSON query (after a quote)
    passage = tok.encode("The parent of Danquen Isdan is Osar.")
    query = tok.encode('{"query": "Danquen Isdan parent"}')
    assert ids["Danquen Isdan"][0] in passage and ids["Danquen Isdan"][0] in query
    # whole words only: a longer word that starts with a name keeps its pieces
    assert ids["Osar"][0] not in tok.encode("Osarfen is a city.")
    assert tok.special == plain.special and tok.vocab_size == plain.vocab_size + 3  # added after Qwen's tokens
    text = "Vase of Noryarnor; Osar, 1937."
    assert tok.decode(tok.encode(text)) == text
    tok.save(tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).encode(text) == tok.encode(text)
    with pytest.raises(ValueError, match="whole_words"):
        train_bpe_tokenizer(CORPUS, 400, whole_words=[" Osar"])


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_encode_decode_round_trips_any_text(text):
    tok = tiny_tokenizer()
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_special_tokens_in_text_map_to_their_ids():
    tok = tiny_tokenizer()
    s = tok.special
    ids = tok.encode("<think>a</think><tool_call>b</tool_call><|image_pad|>")
    assert [s.think_start, s.think_end, s.tool_call_start, s.tool_call_end, s.image_pad] == [
        i for i in ids if i >= s.endoftext
    ]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think><tool_call>b</tool_call>"


def test_save_and_reload(tmp_path):
    tok = tiny_tokenizer()
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.special == tok.special
    assert again.encode(CORPUS[0]) == tok.encode(CORPUS[0])


def test_special_token_names():
    special = tiny_tokenizer().special
    assert special.token("image_pad") == "<|image_pad|>"
    with pytest.raises(ValueError, match="unknown special token"):
        special.token("pad")


def test_missing_special_tokens_raise(tmp_path):
    backend = Backend(models.BPE(vocab={"a": 0}, merges=[]))
    with pytest.raises(ValueError, match=r"lacks Qwen3-VL special tokens: <\|endoftext\|>"):
        Tokenizer(backend)
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="lacks"):
        load_tokenizer(tmp_path)


def test_bad_files_raise(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot parse"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"corpus": CORPUS, "vocab_size": 100}, "vocab_size"),
        ({"corpus": ["", ""], "vocab_size": 400}, "empty corpus"),
        ({"corpus": CORPUS, "vocab_size": 400, "min_frequency": 0}, "min_frequency"),
        ({"corpus": CORPUS, "vocab_size": 400, "max_digits": 4}, "max_digits"),
    ],
)
def test_bad_training_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        train_bpe_tokenizer(**kwargs)


def test_bad_encode_decode_arguments_raise():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])


def test_special_tokens_is_a_typed_record():
    assert SpecialTokens.NAMES["image_pad"] == "<|image_pad|>"


def test_cached_tokenizer_encodes_each_distinct_text_once(monkeypatch):
    plain = tiny_tokenizer()
    encoded = []
    real = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text: encoded.append(text) or real(self, text))
    cached = CachedTokenizer(plain)
    texts = [*CORPUS[:5], "<|im_start|>user\n<|image_pad|><|image_pad|>hi<|im_end|>\n", ""] * 3
    ids = [cached.encode(text) for text in texts]
    assert ids == [real(plain, text) for text in texts]
    assert encoded == texts[:7]  # the backend saw each distinct text once
    ids[0].append(-1)  # callers own what they get
    assert cached.encode(texts[0]) == real(plain, texts[0])
    assert cached.special == plain.special and cached.vocab_size == plain.vocab_size
    with pytest.raises(ValueError, match="encode takes a str"):
        cached.encode(["not", "text"])


def test_decoding_does_not_ask_the_backend_for_its_size():
    """Every generated token's stop check decodes a window; the backend's size lookup costs ~80 us and was
    once read per id, most of the local engine's decode loop."""

    class Counting:
        def __init__(self, backend):
            self.backend, self.size_reads = backend, 0

        def get_vocab_size(self, **kwargs):
            self.size_reads += 1
            return self.backend.get_vocab_size(**kwargs)

        def __getattr__(self, name):
            return getattr(self.backend, name)

    counting = Counting(tiny_tokenizer().backend)
    tok = Tokenizer(counting)
    reads = counting.size_reads
    ids = tok.encode("The bridge opened in 1982.")
    assert tok.decode(ids * 20) == "The bridge opened in 1982." * 20
    assert tok.vocab_size == counting.backend.get_vocab_size(with_added_tokens=True)
    assert counting.size_reads == reads
