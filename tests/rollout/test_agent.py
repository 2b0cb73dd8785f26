import asyncio

import numpy as np
import pytest

from osvl.rl.trajectory import FinishReason, ToolStatus
from osvl.rollout.agent import AgentConfig, parse_action, run_trajectory
from osvl.rollout.engine import EngineError, SamplingParams
from osvl.rollout.local_engine import ReplayEngine
from tests.rollout.helpers import prompts
from tests.rollout.scripts import call, respond, scripted


@pytest.mark.parametrize(
    "text, kind",
    [
        ('<think>a</think><tool_call>{"name": "x"}</tool_call>', "call"),
        ("<response> 42 </response>", "response"),
        ("just rambling", "error"),
        ("<tool_call>{}</tool_call><response>1</response>", "error"),
        ('<tool_call>{"name": "x"', "error"),
    ],
)
def test_parse_action(text, kind):
    action = parse_action(text)
    assert (action.call is not None, action.response is not None, action.error is not None) == (
        kind == "call",
        kind == "response",
        kind == "error",
    )
    if kind == "response":
        assert action.response == "42"


GREEDY = AgentConfig(sampling=SamplingParams(temperature=0.0, max_new_tokens=96))


def _run(engine, env, renderer, config=GREEDY, prompt=None):
    prompt = prompt or prompts(1)[0]
    return asyncio.run(run_trajectory(prompt, engine, env, renderer, config, group_id=0, sample_index=0, seed=1))


def test_tool_call_with_image_then_response(local_engine, env, renderer):
    engine = ReplayEngine(local_engine, scripted([call("echo_image", image=0, tag="b"), respond()]))
    traj = _run(engine, env, renderer)
    assert traj.finish_reason is FinishReason.RESPONSE and traj.fatal_step == -1 and traj.final_answer == "1982"
    first = traj.steps[0]
    assert first.status is ToolStatus.OK and first.tool_call.name == "echo_image"
    assert first.observation_images and np.array_equal(first.observation_images[0], traj.prompt.images[0] + 1)
    assert first.observation_token_ids == renderer.render_observation(first).ids
    rendered = renderer.render_trajectory(traj)  # validates pads vs images and vocabulary
    assert len(rendered.images) == 2
    assert np.allclose(rendered.logprobs[rendered.loss_mask], [lp for s in traj.steps for lp in s.logprobs])
    assert all(len(s.token_ids) == len(s.logprobs) > 0 for s in traj.steps)


def test_forced_tool_faults_make_a_fatal_trajectory_at_the_breach(local_engine, env, renderer):
    turns = [call("echo", tag="ok"), call("refuse"), "garbage without an action", call("nope"), respond()]
    traj = _run(ReplayEngine(local_engine, scripted(turns)), env, renderer)
    assert traj.statuses == [ToolStatus.OK, ToolStatus.TOOL_ERROR, ToolStatus.PARSE_ERROR, ToolStatus.PARSE_ERROR]
    assert traj.finish_reason is FinishReason.FATAL and traj.fatal_step == 3
    assert "Error (tool_error)" in traj.steps[1].observation_text


def test_hanging_tool_times_out_and_the_rollout_goes_on(local_engine, env, renderer):
    config = AgentConfig(sampling=SamplingParams(max_new_tokens=96), tool_deadline_s=0.3)
    traj = _run(ReplayEngine(local_engine, scripted([call("hang"), respond()])), env, renderer, config)
    assert traj.statuses == [ToolStatus.TIMEOUT, None] and traj.finish_reason is FinishReason.RESPONSE


def test_turn_and_token_budgets(local_engine, env, renderer):
    loop = ReplayEngine(local_engine, scripted([call("echo", tag="again")]))
    traj = _run(loop, env, renderer, AgentConfig(max_turns=2, sampling=SamplingParams(max_new_tokens=96)))
    assert traj.finish_reason is FinishReason.MAX_TURNS and len(traj.steps) == 2 and traj.fatal_step == 2
    prompt_len = len(renderer.render_prompt(prompts(1)[0]).ids)
    traj = _run(
        loop, env, renderer, AgentConfig(max_total_tokens=prompt_len + 5, sampling=SamplingParams(max_new_tokens=96))
    )
    assert traj.finish_reason is FinishReason.MAX_TOKENS and len(traj.steps[0].token_ids) == 5


def test_sampled_garbage_never_raises(local_engine, env, renderer):
    config = AgentConfig(max_turns=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=12))
    traj = _run(local_engine, env, renderer, config)
    assert traj.finish_reason in set(FinishReason) - {FinishReason.INFRA_ERROR} and traj.steps
    assert all(s.status in (None, *ToolStatus) for s in traj.steps)
    renderer.render_trajectory(traj)


class CrashingEngine:
    policy_version = 0

    async def generate(self, request):
        raise EngineError("engine worker died")


def test_engine_crash_is_an_infra_error(env, renderer):
    traj = _run(CrashingEngine(), env, renderer)
    assert traj.finish_reason is FinishReason.INFRA_ERROR and traj.steps == []


def test_agent_config_validation():
    with pytest.raises(ValueError, match="max_turns"):
        AgentConfig(max_turns=0)


class _RecordingRunner:
    """Stands in for the tool pool: records each job and answers ok."""

    def __init__(self) -> None:
        self.jobs: list = []

    async def acall(self, job):
        from osvl.rl.trajectory import ToolResult

        self.jobs.append(job)
        return ToolResult(status=ToolStatus.OK, tool=job.tool, text="done")

    def call(self, job):
        return asyncio.run(self.acall(job))


def test_release_profile_call_reaches_its_tool_verbatim(local_engine, renderer):
    """A released checkpoint writes ``parameters``: the agent must hand the call to the profiled
    environment untouched rather than reject it with osvl's own parser first."""
    import json

    from osvl.tools.profiles import ProfiledEnvironment, tool_profile

    runner = _RecordingRunner()
    env = ProfiledEnvironment(tool_profile("release"), runner)
    release_call = (
        "<think>crop</think>\n<tool_call>"
        + json.dumps({"name": "crop", "parameters": {"image": "img_1", "x": 0, "y": 0, "width": 4, "height": 4}})
        + "</tool_call>"
    )
    traj = _run(ReplayEngine(local_engine, scripted([release_call, respond()])), env, renderer)
    assert traj.steps[0].status is ToolStatus.OK and traj.finish_reason is FinishReason.RESPONSE
    (job,) = runner.jobs
    assert job.tool == "crop" and job.arguments["boxes"] == [[0, 0, 4, 4]]


def test_unusable_arguments_are_typed_steps_not_a_crash(local_engine, env, renderer):
    """A 4400-digit integer made json.loads raise inside _act and killed the rollout; NaN and 1e999 too
    must come back as the policy's invalid_arguments, and a lone-surrogate name as a parse error."""

    def raw(text: str) -> str:
        return f"<think>x</think>\n<tool_call>\n{text}\n</tool_call>"

    turns = [
        raw('{"name": "echo", "arguments": {"seconds": 1' + "0" * 4400 + "}}"),
        raw('{"name": "echo", "arguments": {"seconds": 1e999}}'),
        call("echo", tag="ok"),
        raw('{"name": "echo", "arguments": "{\\"seconds\\": NaN}"}'),
        raw('{"name": "\\ud800", "arguments": {}}'),
        respond(),
    ]
    config = AgentConfig(
        max_total_tokens=40_000, fatal=GREEDY.fatal, sampling=SamplingParams(temperature=0.0, max_new_tokens=9000)
    )
    traj = _run(ReplayEngine(local_engine, scripted(turns)), env, renderer, config)
    invalid = ToolStatus.INVALID_ARGUMENTS
    assert traj.statuses == [invalid, invalid, ToolStatus.OK, invalid, ToolStatus.PARSE_ERROR, None]
    assert "'seconds' is an integer of 4401 digits, out of range" in traj.steps[0].tool_result.error
    assert traj.steps[0].tool_call is None
    assert traj.finish_reason is FinishReason.RESPONSE
    renderer.render_trajectory(traj)
