"""Reading-comprehension text: search results rendered as the tools render them, answers copied from them."""

from __future__ import annotations

import json
import random
import re

import pytest

from osvl.synth.__main__ import main
from osvl.synth.reading import ReadingConfig, ReadingSource, reading_corpus, reading_document, sentence_facts


@pytest.fixture(scope="module")
def source(world):
    return ReadingSource.from_world(world)


def test_sentence_templates_become_questions():
    assert sentence_facts("Quenjor", "The mayor of Quenjor is The Golden Admiral.") == [
        ("What is the mayor of Quenjor?", "The Golden Admiral")
    ]
    assert sentence_facts("Quenjor", "Its population is 322000.") == [("What is the population of Quenjor?", "322000")]
    assert sentence_facts("Mitor Tordan", "Mitor Tordan is the founder of Zelgaris Tower.") == [
        ("Mitor Tordan is the founder of what?", "Zelgaris Tower"),
        ("Who or what is the founder of Zelgaris Tower?", "Mitor Tordan"),
    ]
    assert sentence_facts("Quenjor", "Quenjor is a city.") == []


def _split(document: str) -> tuple[str, list[tuple[str, str]]]:
    results, _, questions = document.partition("\n\nQ: ")
    pairs = re.findall(r"(?:^|\n)Q: (.+)\nA: (.+)", "Q: " + questions) if questions else []
    return results, pairs


def test_every_answer_is_a_span_of_the_results_it_follows(source):
    rng = random.Random(0)
    answered = 0
    for _ in range(200):
        document = reading_document(source, rng)
        results, pairs = _split(document)
        assert results.startswith(("[Passage 1] ", "[Match 1] "))
        for question, answer in pairs:
            assert answer in results, (question, answer)
            answered += 1
    assert answered > 400


def test_results_render_as_the_tools_render_them(source, world):
    titles = {record["id"]: record["title"] for record in world.corpus()}
    rng = random.Random(1)
    matches = 0
    for _ in range(100):
        results, pairs = _split(reading_document(source, rng, ReadingConfig(match_fraction=0.5)))
        for page, title in re.findall(r"\[Passage \d+\] (.+)\nURL: world://(\S+)", results):
            assert titles[title] == page
        if results.startswith("[Match 1] "):
            matches += 1
            shown = re.match(r"\[Match 1\] (.+) \(page: (\S+); near_duplicate, score 1\)\nCaption: ", results)
            assert shown and ("What does match 1 show?", shown.group(1)) in pairs
    assert 20 < matches < 80


def test_corpus_is_seeded_and_bounded(source):
    config = ReadingConfig(min_passages=2, max_passages=2, max_sentences=2, max_questions=3, copy_fraction=0.0)
    first = list(reading_corpus([source], 20, seed=5, config=config))
    assert first == list(reading_corpus([source], 20, seed=5, config=config))
    assert first != list(reading_corpus([source], 20, seed=6, config=config))
    for document in first:
        results, pairs = _split(document)
        assert len(re.findall(r"^\[Passage \d+\]", results, flags=re.M)) == 2 and len(pairs) <= 3
        for summary in re.findall(r"Summary: (.+)", results):
            assert summary.count(". ") + 1 <= 2


def test_copy_documents_repeat_their_list(source, world):
    titles = {record["title"] for record in world.corpus()}
    documents = list(reading_corpus([source], 400, seed=2, config=ReadingConfig(copy_fraction=0.5, copy_items=(3, 5))))
    copies = [d for d in documents if d.startswith("List: ")]
    assert 150 < len(copies) < 250  # the rest are reading documents
    made_up = named = 0
    for document in copies:
        listed, repeated, again = re.fullmatch(r"List: (.+)\.\nRepeat: (.+)\.\nAgain: (.+)\.", document).groups()
        assert listed == repeated == again
        items = listed.split("; ")
        assert 3 <= len(items) <= 5
        if any(item in titles for item in items):
            named += 1
        elif all(re.fullmatch(r"[A-Z][a-z]+", item) for item in items):
            made_up += 1
    assert made_up > 40 and named > 40
    assert not any(d.startswith("List: ") for d in reading_corpus([source], 50, config=ReadingConfig(copy_fraction=0)))


def test_bad_settings_are_clear_errors(source):
    with pytest.raises(ValueError, match="min_passages"):
        ReadingConfig(min_passages=3, max_passages=2)
    with pytest.raises(ValueError, match="match_fraction and copy_fraction"):
        ReadingConfig(match_fraction=2.0)
    with pytest.raises(ValueError, match="match_fraction and copy_fraction"):
        ReadingConfig(copy_fraction=-0.1)
    with pytest.raises(ValueError, match="copy_items"):
        ReadingConfig(copy_items=(4, 2))
    with pytest.raises(ValueError, match="at least one world"):
        list(reading_corpus([], 1))


def test_cli_writes_text_records(world, tmp_path, capsys):
    out = tmp_path / "reading.jsonl"
    assert main(["reading", "--world", str(world.root), "--count", "7", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 7 and all(set(r) == {"text"} and r["text"] for r in rows)
    assert json.loads(capsys.readouterr().out)["documents"] == 7
    with pytest.raises(SystemExit):
        main(["reading", "--world", str(tmp_path / "missing"), "--count", "1", "--out", str(out)])
    with pytest.raises(SystemExit):
        main(["reading", "--world", str(world.root), "--count", "1", "--copy-fraction", "2", "--out", str(out)])
