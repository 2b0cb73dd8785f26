"""Tokenizer: a HF ``tokenizer.json`` (Qwen3-VL) or a small BPE trained for tiny recipes.

Both have Qwen3-VL's added-token layout (same names, same order, after the learned vocabulary).
Only the names are shared: the ids differ with the vocabulary size, so every other module asks
:class:`SpecialTokens` for ids and never spells one out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as _Backend

# Qwen3-VL's added tokens in id order (151643 onwards); ``True`` = special (skipped on decode).
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
# Qwen2's pre-tokenizer split (before byte-level mapping): words, single digits, punctuation runs.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the added tokens the renderer, packer and model use, resolved by name."""

    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int
    tool_call_start: int
    tool_call_end: int
    tool_response_start: int
    tool_response_end: int
    think_start: int
    think_end: int

    NAMES = {
        "endoftext": "<|endoftext|>",
        "im_start": "<|im_start|>",
        "im_end": "<|im_end|>",
        "vision_start": "<|vision_start|>",
        "vision_end": "<|vision_end|>",
        "image_pad": "<|image_pad|>",
        "video_pad": "<|video_pad|>",
        "tool_call_start": "<tool_call>",
        "tool_call_end": "</tool_call>",
        "tool_response_start": "<tool_response>",
        "tool_response_end": "</tool_response>",
        "think_start": "<think>",
        "think_end": "</think>",
    }

    @classmethod
    def from_backend(cls, backend: _Backend) -> SpecialTokens:
        ids = {name: backend.token_to_id(token) for name, token in cls.NAMES.items()}
        missing = [cls.NAMES[name] for name, value in ids.items() if value is None]
        if missing:
            raise ValueError(f"tokenizer lacks Qwen3-VL special tokens: {', '.join(missing)}")
        return cls(**ids)

    def token(self, name: str) -> str:
        """The text form of a special token, e.g. ``token("image_pad") == "<|image_pad|>"``."""
        if name not in self.NAMES:
            raise ValueError(f"unknown special token {name!r}; known: {', '.join(self.NAMES)}")
        return self.NAMES[name]


class Tokenizer:
    """Text <-> ids over a ``tokenizers`` backend; added tokens in text map to their ids. The backend is
    complete when wrapped (``train_bpe_tokenizer`` adds its tokens first): its size is read once, since the
    backend's ``get_vocab_size`` costs ~80 us a call and decoding (every generated token's stop check)
    used it per id."""

    def __init__(self, backend: _Backend) -> None:
        self.backend = backend
        self.special = SpecialTokens.from_backend(backend)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        size = self._vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ValueError(f"token ids out of range [0, {size}): {bad[:5]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike[str]) -> None:
        self.backend.save(str(path))


class CachedTokenizer(Tokenizer):
    """Encodes each distinct text once: SFT data repeats its steps and observations (the demo's 51,812
    texts hold 12,030 distinct ones). The ids are kept as int32 arrays, for as long as the instance lives."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer.backend)
        self._ids: dict[str, np.ndarray] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._ids.get(text) if isinstance(text, str) else None
        if ids is None:
            ids = self._ids[text] = np.asarray(super().encode(text), dtype=np.int32)
        return ids.tolist()


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A ``tokenizer.json`` file, or a checkpoint directory holding one."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no tokenizer.json at {path}")
    try:
        backend = _Backend.from_file(str(file))
    except Exception as error:  # the Rust side raises a bare Exception on malformed JSON
        raise ValueError(f"cannot parse {file}: {error}") from None
    return Tokenizer(backend)


def train_bpe_tokenizer(
    corpus: Iterable[str],
    vocab_size: int,
    min_frequency: int = 2,
    max_digits: int = 1,
    whole_words: Sequence[str] = (),
) -> Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokenizer, learned vocab first, Qwen's added tokens after.

    Qwen splits numbers into single digits (``max_digits=1``). With ``max_digits`` = 2 or 3 every
    number is cut into pieces of up to that many digits, each piece one id (100, or 1100, more ids
    after Qwen's): a small policy trained from scratch then copies a number it read as a few distinct
    ids, not as a run of the same ten digit ids, which its two-layer copying circuit confuses.

    ``whole_words`` (e.g. a closed world's entity names) become one id each, matched as whole words
    before pre-tokenization (longest first), after the added tokens above."""
    if max_digits not in (1, 2, 3):
        raise ValueError(f"max_digits must be 1 (Qwen), 2 or 3, got {max_digits}")
    reserved = 256 + len(QWEN_ADDED_TOKENS)
    if vocab_size < reserved:
        raise ValueError(f"vocab_size={vocab_size} must be >= {reserved} (256 bytes + Qwen's added tokens)")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    backend = _Backend(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_ADDED_TOKENS),
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [text for text in corpus if text]
    if not texts:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    backend.train_from_iterator(texts, trainer=trainer)
    for token, special in QWEN_ADDED_TOKENS:  # one at a time: ids follow Qwen's order
        add = backend.add_special_tokens if special else backend.add_tokens
        add([AddedToken(token, special=special, normalized=False)])
    if max_digits > 1:  # matched before pre-tokenization, longest first: "254000" -> "25" "40" "00"
        backend.add_tokens(
            [
                AddedToken(f"{n:0{width}d}", normalized=False)
                for width in range(2, max_digits + 1)
                for n in range(10**width)
            ]
        )
    if whole_words:
        words = sorted(set(whole_words))
        if any(not word.strip() or word != word.strip() for word in words):
            raise ValueError("whole_words must be non-empty and carry no leading or trailing space")
        backend.add_tokens([AddedToken(word, single_word=True, normalized=False) for word in words])
    return Tokenizer(backend)
