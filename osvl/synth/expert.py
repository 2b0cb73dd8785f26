"""Trajectory synthesis with a scripted tool-using expert on the mini-world (Sec. 3.2).

The expert follows the item's intended chain with real tool calls against the world: repair a
degraded image, reverse-search it to find the anchor, then one TextSearch per hop, reading the
next entity (and checking the descriptor's qualifiers) from what the search returned. It slips
at a configured rate (guessing between ambiguous candidates, repeating a query), so the
answer judge and then the process judge have something to reject, as with a real expert model.

Its tools are any :data:`ToolExecutor`: the exact in-process stand-ins below (the default: fast,
deterministic) or the real tool environment (``osvl.synth.environment``). Both render results
in the tool package's format (``[Passage i]`` / ``[Match i]`` blocks), so the expert reads them
the same way and SFT observations look like the ones the policy meets in RL.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import cv2
import numpy as np

from osvl.rl.judges import AccuracyJudge, QueryJudge
from osvl.rl.offline_judges import normalize_answer
from osvl.rl.trajectory import (
    FinishReason,
    Prompt,
    Step,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
)
from osvl.synth.question import Attr, obfuscate
from osvl.synth.records import QAItem
from osvl.tools.image_search import Match, render_matches
from osvl.tools.image_tools import perspective_correct, sharpen
from osvl.tools.text_search import Passage, extractive_summary, query_terms, render_passages
from osvl.world.build import World
from osvl.world.graph import Graph

ToolExecutor = Callable[[ToolCall, list[np.ndarray]], ToolResult]
_WORD = re.compile(r"\w+")
_THUMB = 32
_PASSAGE = re.compile(r"^\[Passage \d+\] (.*)\nURL: (.*)\nSummary: (.*)$", re.MULTILINE)
_TOP_MATCH = re.compile(r"^\[Match 1\] .* \(page: ([^;]*);", re.MULTILINE)
WORLD_URL = "world://"
SHARPEN_ARGS = {"amount": 1.5, "sigma": 2.0}  # strong enough for the degradation subset's blur
SUPER_RESOLUTION_ARGS = {"scale": 4}


def read_passages(text: str) -> list[tuple[str | None, str, str]]:
    """(page id or None, title, summary) of each passage in a text_search observation."""
    return [
        (url.removeprefix(WORLD_URL) if url.startswith(WORLD_URL) else None, title, summary)
        for title, url, summary in _PASSAGE.findall(text)
    ]


def top_match_page(text: str) -> str | None:
    """The page id of the first match of an image_search observation."""
    found = _TOP_MATCH.search(text)
    return found.group(1) if found else None


def _thumbnail(image: np.ndarray) -> np.ndarray:
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    small = cv2.resize(gray, (_THUMB, _THUMB), interpolation=cv2.INTER_AREA).astype(np.float32)
    return (small - small.mean()) / (small.std() + 1e-6)


class WorldTools:
    """Exact offline stand-ins for text_search, image_search and the three repair tools, so the
    expert runs without the tool worker pool; arguments default as in the real tools' schemas."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pages = [(doc["id"], doc["title"], doc["text"]) for doc in world.corpus()]
        self.words = [  # (title words, text words) of each page, for ranking
            (set(normalize_answer(title).split()), set(normalize_answer(text).split())) for _, title, text in self.pages
        ]
        self.searches: dict[tuple[str, int], str] = {}  # the world never changes; drills repeat queries
        self.records = list(world.images())
        self.thumbs = (
            np.stack([_thumbnail(world.load_image(r.page_id)) for r in self.records])
            if self.records
            else np.zeros((0, _THUMB, _THUMB), np.float32)
        )

    def __call__(self, call: ToolCall, images: list[np.ndarray]) -> ToolResult:
        try:
            if call.name == "text_search":
                top_k = int(call.arguments.get("top_k", 3))
                return ToolResult(ToolStatus.OK, call.name, self.text_search(str(call.arguments["query"]), top_k))
            image = images[int(call.arguments["image"])]
            if call.name == "image_search":
                return ToolResult(
                    ToolStatus.OK, call.name, self.image_search(image, int(call.arguments.get("top_k", 3)))
                )
            if call.name == "sharpen":
                amount, sigma = float(call.arguments.get("amount", 1.0)), float(call.arguments.get("sigma", 1.0))
                return ToolResult(ToolStatus.OK, call.name, "sharpened image added", [sharpen(image, amount, sigma)])
            if call.name == "super_resolution":
                scale = int(call.arguments.get("scale", 2))
                up = cv2.resize(image, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
                return ToolResult(ToolStatus.OK, call.name, f"upscaled image added (x{scale})", [up])
            if call.name == "perspective_correct":
                fixed = perspective_correct(image)
                return ToolResult(ToolStatus.OK, call.name, fixed.note, [fixed.image])
        except (KeyError, IndexError, ValueError) as bad:
            return ToolResult(ToolStatus.TOOL_ERROR, call.name, error=f"bad arguments: {bad}")
        return ToolResult(ToolStatus.TOOL_ERROR, call.name, error=f"unknown tool {call.name!r}")

    def text_search(self, query: str, top_k: int = 3) -> str:
        """Rank pages by query words in title (x3) and text, a full-title match first; summarise each
        as the offline tool does (:func:`osvl.tools.text_search.extractive_summary`), so what the expert
        reads is what the policy will read."""
        if (query, top_k) not in self.searches:
            self.searches[query, top_k] = self._rank(query, top_k)
        return self.searches[query, top_k]

    def _rank(self, query: str, top_k: int) -> str:
        words = set(normalize_answer(query).split())
        scored = []
        for index, (title, text) in enumerate(self.words):
            score = 3 * len(words & title) + len(words & text) + (5 if title and title <= words else 0)
            if score:
                scored.append((-score, index))
        passages = []
        terms = query_terms(query)
        for _, index in sorted(scored)[:top_k]:
            page_id, title, text = self.pages[index]
            passages.append(Passage(title, WORLD_URL + page_id, extractive_summary(text, terms, title=title)))
        return render_passages(passages) if passages else "no results"

    def image_search(self, image: np.ndarray, top_k: int = 3) -> str:
        """Nearest thumbnails; the score is the thumbnails' correlation (1 - MSE / 2 when z-scored)."""
        distances = ((self.thumbs - _thumbnail(image)[None]) ** 2).mean(axis=(1, 2))
        order = np.argsort(distances, kind="stable")[:top_k]
        return render_matches(
            [
                Match(
                    self.records[i].title,
                    self.records[i].caption,
                    self.records[i].page_id,
                    "near_duplicate",
                    round(1.0 - float(distances[i]) / 2.0, 4),
                )
                for i in order
            ]
        )


@dataclass(frozen=True)
class ExpertConfig:
    slip_prob: float = 0.25  # guess among ambiguous candidates instead of checking qualifiers
    repeat_prob: float = 0.15  # repeat the previous query once (a wasted call)
    # passages the expert asks each text_search for (0 = the tool's default). The demo asks for 1:
    # half the tokens per trajectory, and one candidate per observation for a tiny policy to copy
    search_top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("slip_prob", "repeat_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ExpertConfig.{name} must lie in [0, 1]")
        if self.search_top_k < 0:
            raise ValueError(f"ExpertConfig.search_top_k must be >= 0, got {self.search_top_k}")


def expert_step(think: str, call: ToolCall | None, result: ToolResult | None, response: str | None = None) -> Step:
    """A step written the way the policy emits it, with the tool result as its observation."""
    if call is not None:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        text = f"<think>{think}</think>\n<tool_call>{body}</tool_call>"
    else:
        text = f"<think>{think}</think>\n<response>{response}</response>"
    return Step(
        token_ids=[],
        logprobs=[],
        text=text,
        think=think,
        tool_call=call,
        response=response,
        tool_result=result,
        observation_text=result.observation if result is not None else "",
        observation_images=list(result.images) if result is not None else [],
    )


def answer_step(attribute: str, title: str, stated: str, answer: str) -> Step:
    """The final step restates the fact it answers from before giving the answer: the reasoning a
    reader (or a judge of the process) can check, and a short copy path for a small policy."""
    think = f"The {attribute} of {title} is {stated}."
    if answer != stated:
        think += f" So the answer is {answer}."
    return expert_step(think, None, None, response=answer)


@dataclass
class ScriptedExpert:
    graph: Graph
    tools: ToolExecutor
    config: ExpertConfig = field(default_factory=ExpertConfig)
    _title_words: Counter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._title_words = Counter(w for p in self.graph.entities() for w in set(_WORD.findall(p.title.lower())))

    def _rarest_title_word(self, page_id: str) -> str:
        words = _WORD.findall(self.graph[page_id].title.lower())
        return min(words, key=lambda w: (self._title_words[w], -len(w)))

    def _read_attributes(self, call, page_id: str, keys: list[str], think: str) -> dict[str, str]:
        """The ``Its <key> is <value>.`` facts the page's passage states. A search summary keeps only
        a page's few best-matching sentences, and on a long page the title's own words can crowd
        the attribute out; then the expert asks again, naming the page by its rarest title word."""
        title = self.graph[page_id].title

        def stated(result: ToolResult, wanted: list[str]) -> dict[str, str]:
            own = " ".join(summary for page, _, summary in read_passages(result.text) if page == page_id)
            found = {key: re.search(rf"Its {re.escape(key)} is ([^.]+)\.", own) for key in wanted}
            return {key: match.group(1) for key, match in found.items() if match}

        values = stated(call(think, "text_search", query=f"{title} {' '.join(keys)}"), keys)
        for key in [k for k in keys if k not in values]:
            narrow = call(
                f"The result does not state the {key} of {title}; search more narrowly.",
                "text_search",
                query=f"{self._rarest_title_word(page_id)} its {key}",
            )
            values.update(stated(narrow, [key]))
        return values

    def rollout(self, item: QAItem, image: np.ndarray, rng: random.Random) -> list[Step]:
        steps: list[Step] = []
        images = [image]

        def call(think: str, name: str, **arguments) -> ToolResult:
            if name == "text_search" and self.config.search_top_k:
                arguments["top_k"] = self.config.search_top_k
            tool_call = ToolCall(name, arguments)
            result = self.tools(tool_call, images)
            images.extend(result.images)
            steps.append(expert_step(think, tool_call, result))
            return result

        if item.degradation is not None:
            tool = item.degradation["repair_tool"]
            extra = {"sharpen": SHARPEN_ARGS, "super_resolution": SUPER_RESOLUTION_ARGS}.get(tool, {})
            call(
                f"The image looks degraded ({item.degradation['kind']}); repair it before searching.",
                tool,
                image=0,
                **extra,
            )
        found = call(
            "Identify what the image shows with a reverse image search.", "image_search", image=len(images) - 1, top_k=1
        )  # only the best match is read
        top = top_match_page(found.text)
        current = self.graph.resolve(top) if top is not None else None
        for index in range(1, len(item.path)):
            if current is None:
                break
            title, relation = self.graph[current].title, item.relations[index - 1]
            query = f"{title} {relation}"
            result = call(f"Find the {relation} of {title}.", "text_search", query=query)
            if rng.random() < self.config.repeat_prob:
                result = call("Search again to be sure.", "text_search", query=query)
            pattern = re.compile(rf"The {re.escape(relation)} of {re.escape(title)} is ([^.]+)\.")
            names = list(
                dict.fromkeys(n for _, _, summary in read_passages(result.text) for n in pattern.findall(summary))
            )
            candidates = [p.id for n in names for p in self.graph.entities() if p.title == n.strip()]
            current = self._choose(candidates, item, index, rng, call)
        if current is not None:
            title = self.graph[current].title
            stated = self._read_attributes(
                call, current, [item.attribute], f"Look up the {item.attribute} of {title}."
            ).get(item.attribute)
            answer = obfuscate(stated, item.question.obfuscation) if stated else None
            if answer:
                steps.append(answer_step(item.attribute, title, stated, answer))
                return steps
        steps.append(expert_step("The chain broke off before the asked value.", None, None, response="unknown"))
        return steps

    def _choose(self, candidates: list[str], item: QAItem, index: int, rng: random.Random, call) -> str | None:
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        qualifiers = [c for c in item.question.mentions[index].constraints if isinstance(c, Attr)]
        if not qualifiers or rng.random() < self.config.slip_prob:
            return rng.choice(candidates)
        for candidate in candidates:
            values = self._read_attributes(
                call,
                candidate,
                [q.key for q in qualifiers],
                f"Check which candidate matches: {self.graph[candidate].title}.",
            )
            if all(values.get(q.key) == str(q.value) for q in qualifiers):
                return candidate
        return None


class Expert(Protocol):
    """One attempt at an item: the steps, ending with a response step when it answered."""

    def rollout(self, item: QAItem, image: np.ndarray, rng: random.Random) -> list[Step]: ...


@dataclass
class SynthesisReport:
    rollouts: int = 0
    kept: int = 0
    incomplete: int = 0  # no response: expert outage, turn budget, fatal tool-error cascade
    rejected_answer: int = 0
    rejected_process: int = 0
    unscored: int = 0


def synthesize(
    item: QAItem,
    image: np.ndarray,
    expert: Expert,
    rollouts: int,
    rng: random.Random,
    answer_judge: AccuracyJudge,
    process_judge: QueryJudge,
    min_process_score: float,
    report: SynthesisReport,
    group_id: int,
) -> list[Trajectory]:
    """``rollouts`` expert attempts; keep those that end with a response the answer judge accepts
    and the process judge rates at least ``min_process_score`` (a judge outage rejects: SFT data
    is never unverified)."""
    prompt = Prompt(id=item.id, question=item.text, images=[image], answer=item.answer, aliases=item.aliases)
    kept = []
    for sample in range(rollouts):
        steps = expert.rollout(item, image, rng)
        report.rollouts += 1
        if not steps or steps[-1].response is None:
            report.incomplete += 1
            continue
        accuracy = answer_judge.judge_answer(prompt, steps[-1].response)
        if accuracy.score is None:
            report.unscored += 1
            continue
        if accuracy.score < 1.0:
            report.rejected_answer += 1
            continue
        process = process_judge.judge_queries(prompt, steps)
        if process.score is None:
            report.unscored += 1
            continue
        if process.score < min_process_score:
            report.rejected_process += 1
            continue
        report.kept += 1
        kept.append(
            Trajectory(
                prompt=prompt, steps=steps, finish_reason=FinishReason.RESPONSE, group_id=group_id, sample_index=sample
            )
        )
    return kept
