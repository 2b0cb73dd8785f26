"""Offline judges, for tests and the demo: ``r_acc`` by normalized exact/alias match, ``r_query`` by
four deterministic proxies of the LLM judge's rubric. ``normalize_answer`` is also how synthesis
compares answers."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence

from osvl.rl.judges import Verdict
from osvl.rl.trajectory import Prompt, Step, ToolStatus

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Casefolded NFKC text without punctuation, English articles or extra whitespace."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


class ExactMatchAccuracyJudge:
    """Offline ``r_acc``: 1 when the normalized response equals the answer or an alias."""

    name = "offline:exact_match"

    def judge_answer(self, prompt: Prompt, response: str) -> Verdict:
        accepted = {normalize_answer(a) for a in prompt.accepted_answers} - {""}
        hit = normalize_answer(response) in accepted
        return Verdict(1.0 if hit else 0.0, "match" if hit else "no match", 0, self.name)


_QUERY_ARGUMENTS = ("query", "queries", "q", "search_query")
_VISUAL_TOOL_WORDS = ("image", "crop", "ocr", "sharpen", "super", "perspective", "zoom")
_STOPWORDS = frozenset(
    "the a an of in on at to for from by with and or is are was were be this that what which who "
    "whom whose when where why how did does do it its as into than then".split()
)


def text_queries(step: Step) -> list[str]:
    if step.tool_call is None:
        return []
    found: list[str] = []
    for key in _QUERY_ARGUMENTS:
        value = step.tool_call.arguments.get(key)
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, list):
            found.extend(v for v in value if isinstance(v, str))
    return found


def _content_words(text: str) -> set[str]:
    return {w for w in normalize_answer(text).split() if len(w) > 2 and w not in _STOPWORDS}


class HeuristicQueryJudge:
    """Offline ``r_query``: a deterministic stand-in for the rubric, mean of four proxies in [0, 1].

    relevance: share of text queries with a content word from the question; progression: share
    of calls that are not exact repeats; signal_to_noise: share of calls that returned something;
    cross_modal: 1 when visual tools and text search are both used, 0.5 for one kind, else 0.
    """

    name = "offline:query_heuristic"

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        calls = [s for s in steps if s.tool_call is not None or s.tool_result is not None]
        if not calls:
            return Verdict(0.0, "no tool calls", 0, self.name)
        question_words = _content_words(prompt.question)
        queries = [q for s in calls for q in text_queries(s)]
        relevance = sum(bool(_content_words(q) & question_words) for q in queries) / len(queries) if queries else 0.0
        keys = [
            json.dumps([s.tool_call.name, s.tool_call.arguments], sort_keys=True, default=str)
            if s.tool_call is not None
            else f"unparsed:{i}"
            for i, s in enumerate(calls)
        ]
        progression = len(set(keys)) / len(keys)
        signal = sum(
            s.tool_result is not None
            and s.tool_result.status is ToolStatus.OK
            and bool(s.tool_result.text.strip() or s.tool_result.images)
            for s in calls
        ) / len(calls)
        names = [s.tool_call.name.lower() for s in calls if s.tool_call is not None]
        uses_visual = any(word in name for name in names for word in _VISUAL_TOOL_WORDS)
        uses_text = any(
            text_queries(s) and "image" not in s.tool_call.name.lower() for s in calls if s.tool_call is not None
        )
        cross_modal = (uses_visual + uses_text) / 2.0
        score = (relevance + progression + signal + cross_modal) / 4.0
        return Verdict(
            score,
            f"relevance={relevance:.2f} progression={progression:.2f} "
            f"signal={signal:.2f} cross_modal={cross_modal:.2f}",
            0,
            self.name,
        )
