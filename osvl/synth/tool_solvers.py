"""Staged-filter solvers backed by real tools and a chat model (the exact ones: ``filtering.py``).

``ToolImageSearchSolver`` makes one real ImageSearch call (``osvl.tools``' pHash/ORB index over
the world's images, or any configured backend) and knows only what came back: the top match is
the entity it recognised, and that match's caption states its facts (``"<title>, a <kind>;
<relation>: <name>"``). ``ChatClosedBookSolver`` asks an OpenAI-compatible model for the answer
with no tools. Both plug into ``CachedSolver``/``SolverFilter``; an outage raises
:class:`SolverUnavailable` so the stage stops undecided instead of keeping an item by accident.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from osvl.rl.chat_client import ChatCompletionsClient
from osvl.rl.offline_judges import normalize_answer
from osvl.rl.trajectory import ToolCall, ToolStatus
from osvl.synth.chat_expert import image_content_part
from osvl.synth.expert import ToolExecutor, top_match_page
from osvl.synth.filtering import KnownFacts, SolverAnswer, exact_answer, famous_entities
from osvl.synth.llm import last_json_object
from osvl.synth.question import name_index
from osvl.synth.records import QAItem
from osvl.world.graph import Graph

_TOP_CAPTION = re.compile(r"^\[Match 1\] .*\nCaption: (.*)$", re.MULTILINE)
_NO_ANSWER = {"", "unknown", "none", "null", "n/a", "i don't know", "i do not know"}

CLOSED_BOOK_PROMPT_V1 = """Answer the question from your own knowledge; you have no tools.
Question: {question}
Reply with JSON only: {{"answer": "a short answer"}}, or {{"answer": null}} if you do not know."""


ONE_IMAGE_SEARCH_PROMPT_V1 = """You may not search further. One reverse image search of the question image returned:
{observation}
Question: {question}
Answer from this result and your own knowledge.
Reply with JSON only: {{"answer": "a short answer"}}, or {{"answer": null}} if you do not know."""


class SolverUnavailable(RuntimeError):
    """The solver's backend failed (tool infrastructure, model endpoint): no verdict was reached."""


def caption_facts(caption: str) -> list[tuple[str, str]]:
    """The ``(relation, name)`` pairs a world caption states after its ``"<title>, a <kind>"`` head."""
    pairs = []
    for part in caption.split("; ")[1:]:
        relation, sep, name = part.partition(": ")
        if sep and relation.strip() and name.strip():
            pairs.append((relation.strip(), name.strip()))
    return pairs


@dataclass
class ToolImageSearchSolver:
    graph: Graph
    tools: ToolExecutor
    image: Callable[[QAItem], np.ndarray]  # the item's question image
    fame_in_degree: int
    top_k: int = 1
    name: str = "tool_image_search"
    _famous: frozenset[str] = field(init=False, repr=False)
    _names: dict[str, set[str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"ToolImageSearchSolver.top_k must be >= 1, got {self.top_k}")
        self._famous = famous_entities(self.graph, self.fame_in_degree)
        self._names = name_index(self.graph)

    def recognise(self, item: QAItem) -> tuple[str | None, list[tuple[str, str]]]:
        """The entity the search's top match names, and the caption facts of that match."""
        result = self.tools(ToolCall("image_search", {"image": 0, "top_k": self.top_k}), [self.image(item)])
        if result.status is ToolStatus.INFRA_ERROR:
            raise SolverUnavailable(f"image_search failed for item {item.id}: {result.error}")
        if not result.ok:  # e.g. no visual match: nothing recognised
            return None, []
        page = top_match_page(result.text)
        caption = _TOP_CAPTION.search(result.text)
        anchor = self.graph.resolve(page) if page is not None and page in self.graph else None
        return anchor, caption_facts(caption.group(1)) if caption else []

    def solve(self, item: QAItem) -> SolverAnswer:
        return self.answer(item, *self.recognise(item))

    def answer(self, item: QAItem, anchor: str | None, stated: list[tuple[str, str]]) -> SolverAnswer:
        """What famous facts plus the recognised anchor and its caption facts pin down."""
        if anchor is None:
            return SolverAnswer(None, 1)
        edges = {
            (anchor, relation, target)
            for relation, name in stated
            for target in self._names.get(normalize_answer(name), ())
        }
        facts = KnownFacts(self.graph, self._famous, edges)
        return SolverAnswer(exact_answer(facts, item, image_entity=anchor, names=self._names), 1)


@dataclass
class ChatClosedBookSolver:
    """A chat model with no tools; with ``image`` it also sees the question image (a VLM)."""

    client: ChatCompletionsClient
    image: Callable[[QAItem], np.ndarray] | None = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = f"chat_closed_book:{self.client.config.model}:v1"

    def solve(self, item: QAItem) -> SolverAnswer:
        text = CLOSED_BOOK_PROMPT_V1.format(question=item.text)
        content = text if self.image is None else [{"type": "text", "text": text}, image_content_part(self.image(item))]
        return ask_for_answer(self.client, content, item, tool_calls=0)


def ask_for_answer(client: ChatCompletionsClient, content: str | list, item: QAItem, tool_calls: int) -> SolverAnswer:
    """The model's committed answer to one user turn; an unreachable model raises."""
    outcome = client.complete([{"role": "user", "content": content}])
    if outcome.text is None:
        raise SolverUnavailable(f"solver model failed for item {item.id}: {outcome.error}")
    reply = last_json_object(outcome.text)
    answer = reply.get("answer") if reply else None
    if not isinstance(answer, str) or normalize_answer(answer) in _NO_ANSWER:
        return SolverAnswer(None, tool_calls)  # no committed answer: the item is not easy for it
    return SolverAnswer(answer.strip(), tool_calls)


@dataclass
class ChatImageSearchSolver:
    """Stage 2 as the paper runs it in open worlds: a chat model that gets one real ImageSearch
    result for the question image, then must answer (no exact resolution: free-text questions)."""

    client: ChatCompletionsClient
    tools: ToolExecutor
    image: Callable[[QAItem], np.ndarray]
    top_k: int = 3
    name: str = field(init=False)

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"ChatImageSearchSolver.top_k must be >= 1, got {self.top_k}")
        self.name = f"chat_image_search:{self.client.config.model}:top{self.top_k}:v1"

    def solve(self, item: QAItem) -> SolverAnswer:
        result = self.tools(ToolCall("image_search", {"image": 0, "top_k": self.top_k}), [self.image(item)])
        if result.status is ToolStatus.INFRA_ERROR:
            raise SolverUnavailable(f"image_search failed for item {item.id}: {result.error}")
        observation = result.text if result.ok else f"Error ({result.status.value}): {result.error}"
        return ask_for_answer(
            self.client,
            ONE_IMAGE_SEARCH_PROMPT_V1.format(observation=observation, question=item.text),
            item,
            tool_calls=1,
        )
