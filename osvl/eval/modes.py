"""The paper's three evaluation workflows as answerers: one prompt in, one :class:`Attempt` out.

direct: a single generation from the image and question alone. rag: one fixed retrieval pass
(text search on the question, image search on the first image) placed in context, then a single
generation. agentic: the rollout's ReAct loop with the tools. Every attempt keeps the full
trajectory; an engine failure is an ``infra_error`` attempt (retried on resume, never scored).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from osvl.data.chat import ChatRenderer
from osvl.eval.judge import load_prompt
from osvl.rl.trajectory import FinishReason, Prompt, Step, Trajectory
from osvl.rollout.agent import AgentConfig, parse_action, run_trajectory
from osvl.rollout.engine import (
    Engine,
    EngineError,
    GenerationRequest,
    SamplingParams,
    StopKind,
)
from osvl.tools.environment import ToolEnvironment
from osvl.tools.visual_context import VisualContext

Mode = Literal["direct", "rag", "agentic"]
MODES: tuple[Mode, ...] = ("direct", "rag", "agentic")
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


@dataclass
class Attempt:
    """What one item's run produced, with the counts the cost summary needs."""

    trajectory: Trajectory
    answer: str | None
    tool_calls: int
    generated_tokens: int
    context_tokens: int  # the whole final context: prompt, generations and observations
    retrieval: list[dict[str, Any]] = field(default_factory=list)  # rag evidence as shown

    @property
    def infra_error(self) -> bool:
        return self.trajectory.finish_reason is FinishReason.INFRA_ERROR


class Answerer(Protocol):
    mode: Mode

    async def attempt(self, prompt: Prompt, seed: int) -> Attempt: ...


def system_prompt(name: str) -> str:
    return load_prompt(name).template.strip()


def extract_answer(text: str) -> str | None:
    """The ``<response>`` body, else the text without its thinking (plain answers count)."""
    action = parse_action(text)
    if action.response is not None:
        return action.response or None
    plain = _THINK.sub("", text).replace("<response>", "").strip()
    return plain or None


def _stats(traj: Trajectory, prompt_ids: int) -> tuple[int, int]:
    generated = sum(len(s.token_ids) for s in traj.steps)
    return generated, prompt_ids + generated + sum(len(s.observation_token_ids) for s in traj.steps)


async def _single_turn(
    prompt: Prompt, engine: Engine, renderer: ChatRenderer, sampling: SamplingParams, seed: int, record_prompt: Prompt
) -> tuple[Trajectory, str | None, int]:
    segment = renderer.render_prompt(prompt)
    special = renderer.tokenizer.special
    params = replace(
        sampling,
        seed=seed,
        stop=("</response>",),
        stop_token_ids=tuple(sorted({*sampling.stop_token_ids, special.im_end, special.endoftext})),
    )
    try:
        result = await engine.generate(GenerationRequest(list(segment.ids), list(segment.images), params))
    except EngineError:
        return Trajectory(record_prompt, [], FinishReason.INFRA_ERROR, 0, 0), None, len(segment.ids)
    text = renderer.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    answer = extract_answer(text)
    step = Step(
        token_ids=list(result.token_ids),
        logprobs=[float(x) for x in result.logprobs],
        text=text,
        think=parse_action(text).think,
        response=answer,
        policy_version=result.policy_version,
    )
    finish = FinishReason.MAX_TOKENS if result.finish is StopKind.LENGTH else FinishReason.RESPONSE
    return Trajectory(record_prompt, [step], finish, 0, 0), answer, len(segment.ids)


class DirectAnswerer:
    mode: Mode = "direct"

    def __init__(self, engine: Engine, renderer: ChatRenderer, sampling: SamplingParams) -> None:
        self.engine, self.renderer, self.sampling = engine, renderer, sampling

    async def attempt(self, prompt: Prompt, seed: int) -> Attempt:
        traj, answer, prompt_ids = await _single_turn(prompt, self.engine, self.renderer, self.sampling, seed, prompt)
        return Attempt(traj, answer, 0, *_stats(traj, prompt_ids))


def _excerpt(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class RagAnswerer:
    """One retrieval pass in context; the record's prompt is the augmented question the model saw."""

    mode: Mode = "rag"

    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        sampling: SamplingParams,
        env: ToolEnvironment,
        evidence_chars: int = 2000,
        template: str = "rag_question.v1.txt",
    ) -> None:
        self.engine, self.renderer, self.sampling, self.env = engine, renderer, sampling, env
        self.evidence_chars = evidence_chars
        self.template = load_prompt(template)

    async def retrieve(self, prompt: Prompt) -> list[dict[str, Any]]:
        context = VisualContext(prompt.images, self.env.registry.limits)
        limit = self.env.registry.limits.max_text_chars
        calls: list[dict[str, Any]] = [{"name": "text_search", "arguments": {"query": prompt.question[:limit]}}]
        if prompt.images:
            calls.append({"name": "image_search", "arguments": {"image": 0}})
        evidence = []
        for call in calls:
            result = await self.env.execute(call, context)
            evidence.append(
                {
                    "tool": call["name"],
                    "status": result.status.value,
                    "text": _excerpt(result.text if result.ok else f"({result.error})", self.evidence_chars),
                }
            )
        return evidence

    async def attempt(self, prompt: Prompt, seed: int) -> Attempt:
        evidence = await self.retrieve(prompt)
        shown = "\n\n".join(f"[{e['tool']}] {e['text']}" for e in evidence)
        augmented = replace(prompt, question=self.template.substitute(evidence=shown, question=prompt.question))
        traj, answer, prompt_ids = await _single_turn(
            augmented, self.engine, self.renderer, self.sampling, seed, augmented
        )
        return Attempt(traj, answer, len(evidence), *_stats(traj, prompt_ids), retrieval=evidence)


class AgenticAnswerer:
    """The rollout's agent loop (``osvl.rollout.agent.run_trajectory``) with the tool environment."""

    mode: Mode = "agentic"

    def __init__(self, engine: Engine, renderer: ChatRenderer, env: ToolEnvironment, config: AgentConfig) -> None:
        self.engine, self.renderer, self.env, self.config = engine, renderer, env, config

    async def attempt(self, prompt: Prompt, seed: int) -> Attempt:
        traj = await run_trajectory(
            prompt, self.engine, self.env, self.renderer, self.config, group_id=0, sample_index=0, seed=seed
        )
        calls = sum(s.tool_result is not None for s in traj.steps)
        prompt_ids = len(self.renderer.render_prompt(prompt).ids)
        return Attempt(traj, traj.final_answer, calls, *_stats(traj, prompt_ids))
