"""Offline judges, verdict parsers and the versioned prompt files."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from osvl.rl.chain import EvidenceChainQueryJudge, chain_progress, question_lookups
from osvl.rl.judges import QUERY_DIMENSIONS, describe_calls, load_prompt, parse_accuracy_verdict, parse_query_scores
from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge, normalize_answer
from osvl.rl.trajectory import Prompt

from .helpers import PROMPT, rgb, tool_step


@pytest.mark.parametrize(
    "raw, normalized",
    [
        ("The Kessock Bridge!", "kessock bridge"),
        ("  kessock\tBRIDGE ", "kessock bridge"),
        ("１９８２", "1982"),
        ("Straße", "strasse"),
        ("an apple, a pear", "apple pear"),
        ("“Théâtre”", "théâtre"),
        ("", ""),
    ],
)
def test_normalize_answer(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


def test_exact_match_accepts_aliases_only() -> None:
    judge = ExactMatchAccuracyJudge()
    assert judge.judge_answer(PROMPT, "1982.").score == 1.0
    assert judge.judge_answer(PROMPT, "Nineteen Eighty-Two").score == 1.0
    assert judge.judge_answer(PROMPT, "It opened in 1982").score == 0.0
    assert judge.judge_answer(PROMPT, "1983").score == 0.0
    assert judge.judge_answer(Prompt(id="x", question="q", answer=""), "").score == 0.0


def test_heuristic_query_judge_dimensions() -> None:
    judge = HeuristicQueryJudge()
    question = Prompt(id="x", question="When did the Kessock Bridge open?", images=[rgb(4, 4, 0)])
    assert judge.judge_queries(question, []).score == 0.0
    search = tool_step("ok", arguments={"query": "Kessock Bridge opening date"})
    crop = tool_step("ok", name="crop", arguments={"bbox": [0, 0, 2, 2]}, observation="")
    crop.tool_result.images.append(rgb(2, 2, 1))
    off_topic = tool_step("ok", arguments={"query": "weather tomorrow"})
    failed = tool_step("tool_error", arguments={"query": "bridge"})
    best = judge.judge_queries(question, [crop, search]).score
    assert best == pytest.approx(1.0)
    only_text = judge.judge_queries(question, [search]).score
    assert only_text == pytest.approx((1 + 1 + 1 + 0.5) / 4)
    repeated = judge.judge_queries(question, [search, search]).score
    assert repeated == pytest.approx((1 + 0.5 + 1 + 0.5) / 4)
    noisy = judge.judge_queries(question, [search, off_topic, failed]).score
    assert noisy == pytest.approx((2 / 3 + 1 + 2 / 3 + 0.5) / 4)


@pytest.mark.parametrize(
    "question, parsed",
    [
        ("What is the occupation of the founder of the zoo shown in the image?", (None, ["founder", "occupation"])),
        (
            "What is the height in cm of the mayor of the birthplace of the person shown in the image?",
            (None, ["birthplace", "mayor", "height in cm"]),
        ),
        ("What is the founded of the city shown in the image?", (None, ["founded"])),
        (
            "What is the length in cm of the subject of the exhibit of Zelnorel Tower?",
            ("Zelnorel Tower", ["exhibit", "subject", "length in cm"]),
        ),
        ("What is the population of Vase of Noryarnor?", ("Vase of Noryarnor", ["population"])),
        ("When did the Kessock Bridge open?", None),
        ("What is the population shown in the image?", None),
    ],
)
def test_question_lookups(question: str, parsed) -> None:
    assert question_lookups(question) == parsed


ZOO = Prompt(id="z", question="What is the occupation of the founder of the zoo shown in the image?", answer="x")
MATCH = (
    "[Match 1] Jorzel Zoo (page: Jorzel_Zoo; near_duplicate, score 1)\n"
    "Caption: Jorzel Zoo, a zoo; founder: Jorlo Talcor"
)


def passage(title: str, summary: str) -> str:
    return f"[Passage 1] {title}\nURL: world://{title.replace(' ', '_')}\nSummary: {summary}"


def image_search(observation: str = MATCH, status: str = "ok"):
    return tool_step(status, name="image_search", arguments={"image": 0, "top_k": 1}, observation=observation)


def search(query: str, observation: str, status: str = "ok"):
    return tool_step(status, arguments={"query": query, "top_k": 1}, observation=observation)


FOUNDER = search("Jorzel Zoo founder", passage("Jorzel Zoo", "The founder of Jorzel Zoo is Jorlo Talcor."))
OCCUPATION = search("Jorlo Talcor occupation", passage("Jorlo Talcor", "Its occupation is engineer."))


def test_chain_judge_credits_each_lookup_on_the_entity_the_evidence_named() -> None:
    judge = EvidenceChainQueryJudge()
    assert judge.judge_queries(ZOO, [image_search(), FOUNDER, OCCUPATION]).score == 1.0
    assert judge.judge_queries(ZOO, [image_search(), FOUNDER]).score == 0.5
    assert chain_progress(ZOO.question, [image_search(), FOUNDER]) == (1, 2)
    assert chain_progress("When did the Kessock Bridge open?", [image_search(), FOUNDER]) is None
    # the caption's founder taken for the zoo: the question's first lookup never happens
    misread = search("Jorlo Talcor founder", passage("Jorlo Talcor", "Jorlo Talcor is the founder of Jorzel Zoo."))
    assert judge.judge_queries(ZOO, [image_search(), misread, OCCUPATION]).score == 0.0
    # a later correct lookup after a misread still counts, word order and case free
    recovered = search("founder of jorzel zoo", FOUNDER.tool_result.text)
    assert judge.judge_queries(ZOO, [image_search(), misread, recovered, OCCUPATION]).score == 1.0
    # lookups out of order, without the image search, or on a failed image search earn nothing
    assert judge.judge_queries(ZOO, [OCCUPATION, image_search(), FOUNDER]).score == 0.5
    assert judge.judge_queries(ZOO, [FOUNDER, OCCUPATION]).score == 0.0
    assert judge.judge_queries(ZOO, [image_search(status="tool_error"), FOUNDER, OCCUPATION]).score == 0.0
    # a passage naming no single next entity ends the chain
    vague = search("Jorzel Zoo founder", passage("Jorzel Zoo", "Jorzel Zoo is a zoo."))
    assert judge.judge_queries(ZOO, [image_search(), vague, OCCUPATION]).score == 0.5
    assert judge.judge_queries(ZOO, []).score == 0.0


def test_chain_judge_starts_a_named_question_at_its_name_and_leaves_other_questions_to_the_heuristic() -> None:
    judge = EvidenceChainQueryJudge()
    named = Prompt(id="n", question="What is the occupation of the founder of Jorzel Zoo?", answer="x")
    assert judge.judge_queries(named, [FOUNDER, OCCUPATION]).score == 1.0
    steps = [tool_step("ok", arguments={"query": "Kessock Bridge opening date"})]
    assert judge.judge_queries(PROMPT, steps) == HeuristicQueryJudge().judge_queries(PROMPT, steps)


@settings(max_examples=60, deadline=None)
@given(
    statuses=st.lists(st.sampled_from(["ok", "tool_error", "timeout", "parse_error", None]), max_size=8),
    queries=st.lists(st.text(max_size=20), min_size=8, max_size=8),
)
def test_heuristic_query_score_is_bounded(statuses, queries) -> None:
    steps = [tool_step(s, arguments={"query": q}) for s, q in zip(statuses, queries)]
    score = HeuristicQueryJudge().judge_queries(PROMPT, steps).score
    assert 0.0 <= score <= 1.0


@pytest.mark.parametrize(
    "text, score",
    [
        ("reasoning...\nverdict: correct", 1.0),
        ("verdict: incorrect", 0.0),
        ("VERDICT = Correct", 1.0),
        ("verdict: **incorrect**", 0.0),
        ("first verdict: correct\nfinal verdict: incorrect", 0.0),
        ("The answer is correct.", None),
        ("verdict: incorrectly formatted", None),
        ("", None),
    ],
)
def test_parse_accuracy_verdict(text, score) -> None:
    assert parse_accuracy_verdict(text) == score


@pytest.mark.parametrize(
    "text, score",
    [
        ('{"relevance": 10, "progression": 10, "signal_to_noise": 10, "cross_modal": 10}', 1.0),
        ('bla {"x": 1} then {"relevance": 0, "progression": 4, "signal_to_noise": 2, "cross_modal": 2}', 0.2),
        ('{"relevance": 5, "progression": 5, "signal_to_noise": 5}', None),
        ('{"relevance": 5, "progression": 5, "signal_to_noise": 5, "cross_modal": -1}', None),
        ('{"relevance": true, "progression": 5, "signal_to_noise": 5, "cross_modal": 5}', None),
        ('{"relevance": "5", "progression": 5, "signal_to_noise": 5, "cross_modal": 5}', None),
        ("no json at all", None),
        ("{broken json}", None),
    ],
)
def test_parse_query_scores(text, score) -> None:
    assert parse_query_scores(text) == (None if score is None else pytest.approx(score))


def test_prompt_files_are_versioned_and_complete() -> None:
    accuracy = load_prompt("accuracy_judge.v1.txt")
    filled = accuracy.substitute(question="Q?", references="- A", response="R")
    assert "Q?" in filled and "- A" in filled and "verdict: correct" in filled and "$" not in filled
    query = load_prompt("query_judge.v1.txt")
    filled = query.substitute(question="Q?", calls="1. x")
    for dimension in QUERY_DIMENSIONS:
        assert dimension in filled
    with pytest.raises(FileNotFoundError):
        load_prompt("accuracy_judge.v0.txt")


def test_describe_calls_marks_failures_and_images() -> None:
    crop = tool_step("ok", name="crop", arguments={"bbox": [1, 2, 3, 4]}, observation="x" * 50)
    crop.tool_result.images.append(rgb(2, 2, 0))
    text = describe_calls([crop, tool_step(None), tool_step("timeout")], excerpt_chars=10)
    lines = text.splitlines()
    assert lines[0] == '1. crop {"bbox": [1, 2, 3, 4]} -> ok: xxxxxxxxxx... [+1 image(s)]'
    assert lines[1].endswith("-> not executed") and lines[2].endswith("-> timeout: timeout happened")
