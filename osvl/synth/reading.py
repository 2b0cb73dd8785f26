"""Reading-comprehension text for pretraining a small base model: search results, then questions
answered by copying from them.

A pretrained base already reads a passage and copies a name out of it; a model trained from
random weights on a few hundred agent trajectories does not (it learns the format, then writes a
memorised name where the passage's name belongs). This corpus targets only that skill, as plain
text over worlds *other* than the one the agent is trained and evaluated on: no tool-call syntax,
no chat template, no facts of the target world. (Measured: 800 steps of the tiny preset on it do
not yet produce a model that copies; see docs/demo.md.)

A reading document is one to four search results, rendered exactly as TextSearch and ImageSearch
render them, then ``Q:``/``A:`` lines whose answers are spans of those results; a copy document
lists made-up words, names or numbers and repeats the list twice.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from osvl.tools.image_search import Match, render_matches
from osvl.tools.text_search import Passage, render_passages, split_sentences
from osvl.world.build import ImageRecord, World
from osvl.world.generate import SYLLABLES

_FORWARD = re.compile(r"^The (?P<rel>[^.]+?) of (?P<subj>[^.]+?) is (?P<obj>[^.]+)\.$")
_ATTRIBUTE = re.compile(r"^Its (?P<rel>[^.]+?) is (?P<obj>[^.]+)\.$")
_INVERSE = re.compile(r"^(?P<subj>[^.]+?) is the (?P<rel>[^.]+?) of (?P<obj>[^.]+)\.$")


@dataclass(frozen=True)
class ReadingConfig:
    min_passages: int = 1
    max_passages: int = 4
    max_sentences: int = 4  # per passage summary, as TextSearch keeps a few sentences
    max_questions: int = 6
    match_fraction: float = 0.3  # documents that open with an image-search match
    copy_fraction: float = 0.5  # documents that list words, names and numbers and then repeat the list
    copy_items: tuple[int, int] = (6, 16)  # how many items a copy document lists

    def __post_init__(self) -> None:
        if not 1 <= self.min_passages <= self.max_passages:
            raise ValueError("ReadingConfig: need 1 <= min_passages <= max_passages")
        if self.max_sentences < 1 or self.max_questions < 1:
            raise ValueError("ReadingConfig: max_sentences and max_questions must be >= 1")
        if not (0.0 <= self.match_fraction <= 1.0 and 0.0 <= self.copy_fraction <= 1.0):
            raise ValueError("ReadingConfig: match_fraction and copy_fraction must lie in [0, 1]")
        if not 1 <= self.copy_items[0] <= self.copy_items[1]:
            raise ValueError("ReadingConfig: copy_items must be (low, high) with 1 <= low <= high")


def sentence_facts(title: str, sentence: str) -> list[tuple[str, str]]:
    """(question, answer) pairs one passage sentence answers, by the world's sentence templates."""
    if m := _FORWARD.match(sentence):
        return [(f"What is the {m['rel']} of {m['subj']}?", m["obj"])]
    if m := _ATTRIBUTE.match(sentence):
        return [(f"What is the {m['rel']} of {title}?", m["obj"])]
    if m := _INVERSE.match(sentence):
        return [
            (f"{m['subj']} is the {m['rel']} of what?", m["obj"]),
            (f"Who or what is the {m['rel']} of {m['obj']}?", m["subj"]),
        ]
    return []


def _summary(text: str, rng: random.Random, max_sentences: int) -> list[str]:
    sentences = split_sentences(text)
    if len(sentences) <= max_sentences:
        return sentences
    keep = sorted(rng.sample(range(1, len(sentences)), max_sentences - 1))
    return [sentences[0]] + [sentences[i] for i in keep]


@dataclass(frozen=True)
class ReadingSource:
    """One world's passages and captioned images, held in memory."""

    passages: list[dict]
    images: list[ImageRecord]

    @classmethod
    def from_world(cls, world: World) -> ReadingSource:
        return cls(list(world.corpus()), list(world.images()))


def reading_document(source: ReadingSource, rng: random.Random, config: ReadingConfig = ReadingConfig()) -> str:
    """One document: search results from ``source`` and questions their sentences answer."""
    corpus = source.passages
    records = rng.sample(corpus, rng.randint(config.min_passages, min(config.max_passages, len(corpus))))
    passages, qa = [], []
    for record in records:
        title = record["title"]
        summary = _summary(record["text"], rng, config.max_sentences)
        passages.append(Passage(title, f"world://{record['id']}", " ".join(summary)))
        qa += [pair for sentence in summary for pair in sentence_facts(title, sentence)]
    rng.shuffle(qa)
    parts = []
    if source.images and rng.random() < config.match_fraction:  # the agent's first read: what the image is
        image = rng.choice(source.images)
        parts.append(render_matches([Match(image.title, image.caption, image.page_id, "near_duplicate", 1.0)]))
        qa.insert(0, ("What does match 1 show?", image.title))
    parts.append(render_passages(passages))
    questions = "\n".join(f"Q: {q}\nA: {a}" for q, a in qa[: config.max_questions])
    return "\n\n".join(parts) + ("\n\n" + questions if questions else "")


def copy_document(source: ReadingSource, rng: random.Random, config: ReadingConfig = ReadingConfig()) -> str:
    """A list, then the same list twice more: two thirds of its tokens are copies, the dense signal
    that lets a small model form the attention pattern that continues a span it has seen (a
    passage's name into a query) instead of writing the most familiar name. Half the lists are
    made-up words, which no memorised name can complete; the others are the world's names and
    numbers, which the model must copy against its prior."""
    count = rng.randint(*config.copy_items)
    if rng.random() < 0.5:
        items = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))).capitalize() for _ in range(count)]
    else:
        items = [
            rng.choice(source.passages)["title"] if rng.random() < 0.8 else str(rng.randint(1, 99999))
            for _ in range(count)
        ]
    listed = "; ".join(items)
    return f"List: {listed}.\nRepeat: {listed}.\nAgain: {listed}."


def reading_corpus(
    sources: Sequence[ReadingSource], count: int, seed: int = 0, config: ReadingConfig = ReadingConfig()
) -> Iterator[str]:
    """``count`` documents, each from one world drawn at random."""
    if not sources:
        raise ValueError("reading_corpus needs at least one world")
    rng = random.Random(seed)
    for _ in range(count):
        source = rng.choice(sources)
        copy = config.copy_fraction > 0 and rng.random() < config.copy_fraction  # no draw when off
        make = copy_document if copy else reading_document
        yield make(source, rng, config)
