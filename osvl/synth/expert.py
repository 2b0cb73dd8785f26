"""Trajectory synthesis with a scripted tool-using expert on the mini-world (Sec. 3.2).

The expert follows the item's intended chain with real tool calls against the world: repair a
degraded image, reverse-search it to find the anchor, then one TextSearch per hop, reading the
next entity (and checking the descriptor's qualifiers) from what the search returned. It slips
at a configured rate (guessing between ambiguous candidates, repeating a query), so the
answer judge and then the process judge have something to reject, as with a real expert model.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import cv2
import numpy as np

from osvl.rl.judges import AccuracyJudge, QueryJudge, normalize_answer
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
from osvl.tools.image_tools import perspective_correct, sharpen
from osvl.world.build import World
from osvl.world.graph import Graph

ToolExecutor = Callable[[ToolCall, list[np.ndarray]], ToolResult]
_SENTENCE = re.compile(r"[^.]*\.")
_THUMB = 32


def _thumbnail(image: np.ndarray) -> np.ndarray:
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    small = cv2.resize(gray, (_THUMB, _THUMB), interpolation=cv2.INTER_AREA).astype(np.float32)
    return (small - small.mean()) / (small.std() + 1e-6)


class WorldTools:
    """Exact offline stand-ins for text_search, image_search and the three repair tools, so the
    expert runs without the tool worker pool; observations are plain text plus images."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.docs = []  # (title, title words, text words, [(sentence, sentence words)])
        for doc in world.corpus():
            sentences = [(s.strip(), set(normalize_answer(s).split())) for s in _SENTENCE.findall(doc["text"])]
            self.docs.append((doc["title"], set(normalize_answer(doc["title"]).split()),
                              set().union(*(w for _, w in sentences)) if sentences else set(), sentences))
        self.records = list(world.images())
        self.thumbs = np.stack([_thumbnail(world.load_image(r.page_id)) for r in self.records]) \
            if self.records else np.zeros((0, _THUMB, _THUMB), np.float32)

    def __call__(self, call: ToolCall, images: list[np.ndarray]) -> ToolResult:
        try:
            if call.name == "text_search":
                return ToolResult(ToolStatus.OK, call.name, self.text_search(str(call.arguments["query"])))
            image = images[int(call.arguments["image"])]
            if call.name == "image_search":
                return ToolResult(ToolStatus.OK, call.name, self.image_search(image))
            if call.name == "sharpen":
                return ToolResult(ToolStatus.OK, call.name, "sharpened image added", [sharpen(image, 1.5, 2.0)])
            if call.name == "super_resolution":
                up = cv2.resize(image, None, fx=4, fy=4, interpolation=cv2.INTER_CUBIC)
                return ToolResult(ToolStatus.OK, call.name, "upscaled image added (x4)", [up])
            if call.name == "perspective_correct":
                fixed = perspective_correct(image)
                return ToolResult(ToolStatus.OK, call.name, fixed.note, [fixed.image])
        except (KeyError, IndexError, ValueError) as bad:
            return ToolResult(ToolStatus.TOOL_ERROR, call.name, error=f"bad arguments: {bad}")
        return ToolResult(ToolStatus.TOOL_ERROR, call.name, error=f"unknown tool {call.name!r}")

    def text_search(self, query: str, top_k: int = 3) -> str:
        """Rank pages by query words in title (x3) and text, a full-title match first; show the
        sentences that carry the query's non-title words."""
        words = set(normalize_answer(query).split())
        scored = []
        for index, (_, title, text, _) in enumerate(self.docs):
            score = 3 * len(words & title) + len(words & text) + (5 if title and title <= words else 0)
            if score:
                scored.append((-score, index))
        lines = []
        for _, index in sorted(scored)[:top_k]:
            title, title_words, _, sentences = self.docs[index]
            extra = words - title_words
            shown = [s for s, w in sentences if extra & w] or [s for s, _ in sentences[:2]]
            lines.append(f"[{title}] " + " ".join(shown[:6]))
        return "\n".join(lines) if lines else "no results"

    def image_search(self, image: np.ndarray, top_k: int = 3) -> str:
        distances = ((self.thumbs - _thumbnail(image)[None]) ** 2).mean(axis=(1, 2))
        order = np.argsort(distances, kind="stable")[:top_k]
        return "\n".join(f"{rank + 1}. {self.records[i].title} - {self.records[i].caption}"
                         for rank, i in enumerate(order))


@dataclass(frozen=True)
class ExpertConfig:
    slip_prob: float = 0.25  # guess among ambiguous candidates instead of checking qualifiers
    repeat_prob: float = 0.15  # repeat the previous query once (a wasted call)

    def __post_init__(self) -> None:
        for name in ("slip_prob", "repeat_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ExpertConfig.{name} must lie in [0, 1]")


def _step(think: str, call: ToolCall | None, result: ToolResult | None, response: str | None = None) -> Step:
    if call is not None:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        text = f"<think>{think}</think>\n<tool_call>{body}</tool_call>"
    else:
        text = f"<think>{think}</think>\n<response>{response}</response>"
    return Step(token_ids=[], logprobs=[], text=text, think=think, tool_call=call, response=response,
                tool_result=result, observation_text=result.text if result is not None else "",
                observation_images=list(result.images) if result is not None else [])


@dataclass
class ScriptedExpert:
    graph: Graph
    tools: ToolExecutor
    config: ExpertConfig = field(default_factory=ExpertConfig)

    def _titles(self, text: str) -> dict[str, str]:
        by_title = {normalize_answer(p.title): p.id for p in self.graph.entities()}
        return {t: by_title[normalize_answer(t)] for t in re.findall(r"\[([^\]]+)\]", text)
                if normalize_answer(t) in by_title}

    def rollout(self, item: QAItem, image: np.ndarray, rng: random.Random) -> list[Step]:
        steps: list[Step] = []
        images = [image]

        def call(think: str, name: str, **arguments) -> ToolResult:
            tool_call = ToolCall(name, arguments)
            result = self.tools(tool_call, images)
            images.extend(result.images)
            steps.append(_step(think, tool_call, result))
            return result

        if item.degradation is not None:
            call(f"The image looks degraded ({item.degradation['kind']}); repair it before searching.",
                 item.degradation["repair_tool"], image=0)
        found = call("Identify what the image shows with a reverse image search.", "image_search",
                     image=len(images) - 1)
        top = found.text.split("\n")[0].split(". ", 1)[-1].split(" - ")[0]
        current = next((p.id for p in self.graph.entities() if p.title == top), None)
        for index in range(1, len(item.path)):
            if current is None:
                break
            title, relation = self.graph[current].title, item.relations[index - 1]
            query = f"{title} {relation}"
            result = call(f"Find the {relation} of {title}.", "text_search", query=query)
            if rng.random() < self.config.repeat_prob:
                result = call("Search again to be sure.", "text_search", query=query)
            pattern = re.compile(rf"The {re.escape(relation)} of {re.escape(title)} is ([^.]+)\.")
            names = list(dict.fromkeys(pattern.findall(result.text)))
            candidates = [p.id for n in names for p in self.graph.entities() if p.title == n.strip()]
            current = self._choose(candidates, item, index, rng, call)
        if current is None:
            answer = "unknown"
        else:
            value = self.graph[current].infobox.get(item.attribute)
            check = call(f"Look up the {item.attribute} of {self.graph[current].title}.", "text_search",
                         query=f"{self.graph[current].title} {item.attribute}")
            stated = re.search(rf"Its {re.escape(item.attribute)} is ([^.]+)\.", check.text)
            value = stated.group(1) if stated else value
            answer = (obfuscate(value, item.question.obfuscation) if value else None) or "unknown"
        steps.append(_step("I have followed the chain to the answer.", None, None, response=answer))
        return steps

    def _choose(self, candidates: list[str], item: QAItem, index: int, rng: random.Random, call) -> str | None:
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        qualifiers = [c for c in item.question.mentions[index].constraints if isinstance(c, Attr)]
        if not qualifiers or rng.random() < self.config.slip_prob:
            return rng.choice(candidates)
        for candidate in candidates:
            title = self.graph[candidate].title
            result = call(f"Check which candidate matches: {title}.", "text_search",
                          query=f"{title} {' '.join(q.key for q in qualifiers)}")
            own = next((line for line in result.text.split("\n") if line.startswith(f"[{title}]")), "")
            if all(f"Its {q.key} is {q.value}." in own for q in qualifiers):
                return candidate
        return None


@dataclass
class SynthesisReport:
    rollouts: int = 0
    kept: int = 0
    rejected_answer: int = 0
    rejected_process: int = 0
    unscored: int = 0


def synthesize(item: QAItem, image: np.ndarray, expert: ScriptedExpert, rollouts: int, rng: random.Random,
               answer_judge: AccuracyJudge, process_judge: QueryJudge, min_process_score: float,
               report: SynthesisReport, group_id: int) -> list[Trajectory]:
    """``rollouts`` expert attempts; keep those the answer judge accepts and the process judge rates
    at least ``min_process_score`` (a judge outage rejects: SFT data is never unverified)."""
    prompt = Prompt(id=item.id, question=item.text, images=[image], answer=item.answer, aliases=item.aliases)
    kept = []
    for sample in range(rollouts):
        steps = expert.rollout(item, image, rng)
        report.rollouts += 1
        accuracy = answer_judge.judge_answer(prompt, steps[-1].response or "")
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
        kept.append(Trajectory(prompt=prompt, steps=steps, finish_reason=FinishReason.RESPONSE,
                               group_id=group_id, sample_index=sample))
    return kept
