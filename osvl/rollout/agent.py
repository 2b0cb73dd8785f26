"""The ReAct agent loop for one trajectory: render, generate, parse, act, observe, repeat.

Every failure is data: a malformed generation becomes a ``parse_error`` step, a bad or failed
tool call keeps the tool's typed status, an engine failure ends the rollout as ``infra_error``.
A generation holding a reserved vision placeholder (or an id the tokenizer cannot decode) cannot
be rendered into a next turn nor trained on: the step keeps only the ids before the first such
id, its ``parse_error`` names every offending id and the full engine output, and the rollout
stops as ``malformed`` (see :mod:`osvl.rollout.reserved`).
The record holds the engine's ids and logprobs and the observation ids exactly as the engine
saw them, so the trainer never re-tokenizes.
Each tool call runs with ``current_call`` set to its ``CallIdentity`` (:mod:`osvl.tools.environment`),
so a wrapper of the tool runner (the fault injector) can key decisions on which call it is, not on
when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from osvl.data.chat import ChatRenderer
from osvl.rl.actions import Action, parse_action
from osvl.rl.fatal import FatalConfig, find_fatal_step, trajectory_fatal_step
from osvl.rl.trajectory import (
    FinishReason,
    Prompt,
    Step,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
)
from osvl.rollout.engine import (
    Engine,
    EngineError,
    GenerationPreempted,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
)
from osvl.rollout.reserved import find_unusable, reserved_vision_ids
from osvl.tools.environment import CallIdentity, ToolEnvironment, current_call
from osvl.tools.errors import CallParseError, ToolError
from osvl.tools.registry import parse_tool_call
from osvl.tools.visual_context import VisualContext


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 8
    max_total_tokens: int = 8192  # whole context: prompt, generations and observations
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tool_deadline_s: float | None = None  # None = each tool's own deadline
    fatal: FatalConfig = field(default_factory=FatalConfig)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 2:
            raise ValueError(
                f"max_turns must be >= 1 and max_total_tokens >= 2, got {self.max_turns} and {self.max_total_tokens}"
            )


async def _act(
    action: Action, env: ToolEnvironment, context: VisualContext, config: AgentConfig
) -> tuple[ToolCall | None, ToolResult]:
    if action.error is not None:
        return None, ToolResult(status=ToolStatus.PARSE_ERROR, tool="", error=action.error)
    try:  # the record keeps osvl's reading of the call; a tool profile may still accept one it rejects
        call = parse_tool_call(action.call, env.registry.limits)
    except (CallParseError, ToolError):  # the environment below types the same failure
        call = None
    try:  # the environment gets the call verbatim: a profiled one translates release-style calls first
        result = await env.execute(action.call, context, config.tool_deadline_s)
    except Exception as error:  # noqa: BLE001 - a tool-side crash must not kill the rollout
        result = ToolResult(
            status=ToolStatus.INFRA_ERROR, tool=call.name if call else "", error=f"tool environment failed: {error!r}"
        )
    return call, result


def malformed_step(generation: GenerationResult, renderer: ChatRenderer, reserved: tuple[int, ...]) -> Step | None:
    """The ``parse_error`` step for a generation holding unusable ids, or None when it has none.

    Only the ids before the first unusable one are kept (the trainer renders them verbatim, and
    a pad without pixels cannot be rendered); the error carries the exact engine output.
    """
    tokenizer = renderer.tokenizer
    bad = find_unusable(generation.token_ids, reserved, tokenizer.vocab_size)
    if not bad:
        return None
    cut = bad[0].position
    kept = list(generation.token_ids[:cut])
    names = {i: tokenizer.backend.id_to_token(i) for i in reserved}
    found = ", ".join(f"{names.get(b.token_id, 'out-of-vocabulary')} (id {b.token_id}) at {b.position}" for b in bad)
    error = (
        f"malformed generation: reserved vision or out-of-vocabulary token ids: {found}; "
        f"the rollout stops here; engine ids: {list(generation.token_ids)}"
    )
    return Step(
        token_ids=kept,
        logprobs=[float(x) for x in generation.logprobs[:cut]],
        text=tokenizer.decode(kept, skip_special_tokens=True),
        policy_version=generation.policy_version,
        token_versions=list(generation.token_versions[:cut]) if generation.token_versions else [],
        tool_result=ToolResult(status=ToolStatus.PARSE_ERROR, tool="", error=error),
    )


async def run_trajectory(
    prompt: Prompt,
    engine: Engine,
    env: ToolEnvironment,
    renderer: ChatRenderer,
    config: AgentConfig,
    *,
    group_id: int,
    sample_index: int,
    seed: int | None = None,
) -> Trajectory:
    """One rollout; per-turn seeds follow from ``seed`` so a rerun reproduces every turn."""
    context = VisualContext(prompt.images, env.registry.limits)
    segment = renderer.render_prompt(prompt)
    ids, images = list(segment.ids), list(segment.images)
    steps: list[Step] = []
    finish = FinishReason.MAX_TURNS
    special = renderer.tokenizer.special
    reserved = reserved_vision_ids(renderer.tokenizer)
    for turn in range(config.max_turns):
        room = config.max_total_tokens - len(ids)
        if room < 1:
            finish = FinishReason.MAX_TOKENS
            break
        # reserved ids stop a remote engine at the first one; the local engine never samples them
        sampling = replace(
            config.sampling,
            max_new_tokens=min(config.sampling.max_new_tokens, room),
            seed=None if seed is None else (seed + turn) % 2**63,
            stop_token_ids=tuple(
                sorted({*config.sampling.stop_token_ids, special.im_end, special.endoftext, *reserved})
            ),
        )
        try:
            generation = await engine.generate(GenerationRequest(list(ids), list(images), sampling))
        except GenerationPreempted:
            raise  # the rollout worker starts this trajectory again on the new weights
        except EngineError:
            finish = FinishReason.INFRA_ERROR
            break
        malformed = malformed_step(generation, renderer, reserved)
        if malformed is not None:
            steps.append(malformed)
            finish = FinishReason.MALFORMED
            break
        text = renderer.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        budget_cut = generation.finish is StopKind.LENGTH and sampling.max_new_tokens == room
        action = parse_action(text)
        step = Step(
            token_ids=list(generation.token_ids),
            logprobs=[float(x) for x in generation.logprobs],
            text=text,
            think=action.think,
            policy_version=generation.policy_version,
            token_versions=list(generation.token_versions or []),
        )
        steps.append(step)
        ids += step.token_ids
        if action.response is not None:
            step.response = action.response
            finish = FinishReason.RESPONSE
            break
        if budget_cut:
            finish = FinishReason.MAX_TOKENS
            break
        token = current_call.set(CallIdentity(group_id, sample_index, turn))
        try:
            step.tool_call, step.tool_result = await _act(action, env, context, config)
        finally:
            current_call.reset(token)
        step.observation_text = step.tool_result.observation
        step.observation_images = list(step.tool_result.images) if step.tool_result.ok else []
        if find_fatal_step([s.status for s in steps], config.fatal.k, config.fatal.anchor, config.fatal.errors) != -1:
            finish = FinishReason.FATAL
            break
        observation = renderer.render_observation(step)
        step.observation_token_ids = list(observation.ids)
        ids += observation.ids
        images += observation.images
    trajectory = Trajectory(
        prompt=prompt, steps=steps, finish_reason=finish, group_id=group_id, sample_index=sample_index
    )
    if finish is not FinishReason.INFRA_ERROR:
        trajectory.fatal_step = trajectory_fatal_step(trajectory, config.fatal)
    return trajectory
