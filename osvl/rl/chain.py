"""The demo world's chain questions and what an agent's calls made of them: the sentences of the
mini-world read (its questions, the image search's top match, the passages' "The <relation> of <X> is
<Y>."), how many of a question's lookups the agent issued on the entities its own evidence named
(:func:`chain_progress`), and the offline query judge that scores that share.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from osvl.rl.judges import Verdict
from osvl.rl.offline_judges import HeuristicQueryJudge, normalize_answer, text_queries
from osvl.rl.trajectory import Prompt, Step, ToolStatus

# The demo world's question and observation forms (osvl.synth.drills, osvl.tools): "What is the
# <attribute> of the <relation k> of ... of the <relation 1> of the <kind> shown in the image?" (or "... of
# <Name>?"), image_search's "[Match 1] <Title> (page: ...", text_search's "The <relation> of <Title> is <X>."
_CHAIN_QUESTION = re.compile(r"^What is the (?P<body>.+)\?$")
_SHOWN = " shown in the image"
_TOP_MATCH_TITLE = re.compile(r"^\[Match 1\] (.+?) \(page: ", re.MULTILINE)


def question_lookups(question: str) -> tuple[str | None, list[str]] | None:
    """(start entity, lookups) a chain question asks for: the relations from the start outwards, then the
    attribute; the start is None when it is the entity shown in the image. None for any other question."""
    found = _CHAIN_QUESTION.match(question.strip())
    if found is None:
        return None
    pieces = found.group("body").split(" of the ")
    if pieces[-1].endswith(_SHOWN):
        start, asked = None, pieces[:-1]  # attribute, relation k, ..., relation 1
    else:
        last, sep, start = pieces[-1].partition(" of ")
        if not sep or not start:
            return None
        asked = [*pieces[:-1], last]
    return (start, [*reversed(asked[1:]), asked[0]]) if asked else None


def _stated_targets(observation: str, relation: str, title: str) -> set[str]:
    pattern = re.compile(rf"The {re.escape(relation)} of {re.escape(title)} is ([^.\n]+)\.")
    return set(pattern.findall(observation))


def chain_progress(question: str, steps: Sequence[Step]) -> tuple[int, int] | None:
    """(lookups issued, lookups asked) of a chain question, or None for a question of another form: each
    lookup counts when issued, in order, on the entity the agent's own evidence named (the image search's top
    match, then each passage's "The <relation> of <entity> is <next>."), never looking at the reference."""
    parsed = question_lookups(question)
    if parsed is None:
        return None
    current, lookups = parsed
    done = 0
    for step in steps:
        if step.tool_call is None or step.tool_result is None or step.tool_result.status is not ToolStatus.OK:
            continue
        observation = step.tool_result.text
        if "image" in step.tool_call.name.lower() and current is None and done == 0:
            top = _TOP_MATCH_TITLE.search(observation)
            current = top.group(1) if top else None
            continue
        if current is None or done == len(lookups):
            continue
        wanted = lookups[done]
        query_words = set(normalize_answer(" ".join(text_queries(step))).split())
        if not query_words or not set(normalize_answer(f"{current} {wanted}").split()) <= query_words:
            continue
        done += 1
        if done < len(lookups):
            targets = _stated_targets(observation, wanted, current)
            current = targets.pop() if len(targets) == 1 else None  # no single next entity: the chain ends
    return done, len(lookups)


class EvidenceChainQueryJudge:
    """Offline ``r_query`` for chain questions: the share of the lookups the question asks for that the agent
    issued (:func:`chain_progress`).

    It grades relevance and progression as a careful reader of the calls would: "Jorlo Talcor founder" after
    the image search named Jorzel Zoo earns nothing for the question's "founder of the zoo", even though both
    names appear in the caption. A question outside the chain form gets :class:`HeuristicQueryJudge`'s score.
    """

    name = "offline:query_chain"

    def __init__(self) -> None:
        self._fallback = HeuristicQueryJudge()

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        progress = chain_progress(prompt.question, steps)
        if progress is None:
            return self._fallback.judge_queries(prompt, steps)
        done, asked = progress
        return Verdict(done / asked, f"lookups {done}/{asked}", 0, self.name)
