"""Format reward on adversarial strings, the composite, and the per-trajectory scoring rules."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from osvl.rl.fatal import FatalConfig
from osvl.rl.judges import Verdict
from osvl.rl.rewards import (
    RewardConfig,
    composite_reward,
    format_reward,
    score_batch,
    score_trajectory,
    step_format_valid,
)
from osvl.rl.trajectory import FinishReason, Step, ToolResult

from .helpers import response_step, tool_step, trajectory

CALL = '<tool_call>{"name": "text_search", "arguments": {"query": "x"}}</tool_call>'


def text_step(text: str, status: str | None = None) -> Step:
    result = None if status is None else ToolResult(status=status, tool="text_search")
    return Step(token_ids=[], logprobs=[], text=text, tool_result=result)


VALID_TOOL_STEPS = [
    f"<think>plan</think>{CALL}",
    f"<think>plan</think>\n\n{CALL}\n",
    f"  <think>\nmulti\nline\n</think>\t{CALL}  ",
    f"<think></think>{CALL}",
    '<think>图中的桥 🌉 — Brücke</think><tool_call>{"query": "Кессок"}</tool_call>',
    "<think>a < b and c > d</think><tool_call>x</tool_call>",
]

INVALID_STEPS = {
    "empty": "",
    "no think": CALL,
    "think only": "<think>plan</think>",
    "nested think": f"<think><think>plan</think></think>{CALL}",
    "nested tool call": "<think>p</think><tool_call><tool_call>x</tool_call></tool_call>",
    "missing close of tool call": '<think>plan</think><tool_call>{"name": "x"}',
    "missing close of think": f"<think>plan{CALL}",
    "text between blocks": f"<think>plan</think> Now I search. {CALL}",
    "text before": f"Sure! <think>plan</think>{CALL}",
    "text after": f"<think>plan</think>{CALL} done",
    "two tool calls": f"<think>plan</think>{CALL}{CALL}",
    "two tool calls with whitespace": f"<think>plan</think>{CALL}\n{CALL}",
    "two thinks": f"<think>a</think><think>b</think>{CALL}",
    "tool call and response": f"<think>plan</think>{CALL}<response>1982</response>",
    "mismatched close": "<think>plan</think><tool_call>x</response>",
    "tag inside think": f"<think>I will write <response> later</think>{CALL}",
    "upper case tags": f"<THINK>plan</THINK>{CALL}",
    "full-width brackets": f"＜think＞plan＜/think＞{CALL}",
    "response before think": "<response>1982</response><think>plan</think>",
}


@pytest.mark.parametrize("text", VALID_TOOL_STEPS)
def test_valid_tool_steps(text: str) -> None:
    assert step_format_valid(text_step(text, "ok"), is_last=False)
    assert step_format_valid(text_step(text), is_last=False)


@pytest.mark.parametrize("name", sorted(INVALID_STEPS))
@pytest.mark.parametrize("is_last", [False, True])
def test_invalid_steps(name: str, is_last: bool) -> None:
    assert not step_format_valid(text_step(INVALID_STEPS[name], "ok"), is_last=is_last)


def test_response_only_valid_as_last_step() -> None:
    step = text_step("<think>done</think>\n<response>1982 — 一九八二</response>")
    assert step_format_valid(step, is_last=True)
    assert not step_format_valid(step, is_last=False)


@pytest.mark.parametrize(
    "status, valid",
    [
        ("ok", True),
        ("tool_error", False),
        ("parse_error", False),
        ("timeout", False),
        ("infra_error", True),
        (None, True),
    ],
)
def test_tool_execution_errors_make_the_step_invalid(status, valid) -> None:
    assert step_format_valid(text_step(f"<think>p</think>{CALL}", status), is_last=False) is valid


def test_format_reward_is_a_fraction() -> None:
    steps = [
        text_step(f"<think>p</think>{CALL}", "ok"),
        text_step(f"<think>p</think>{CALL}", "timeout"),
        text_step("junk", "ok"),
        response_step(),
    ]
    assert format_reward(steps) == pytest.approx(0.5)
    assert format_reward([]) == 0.0
    assert format_reward([response_step()]) == 1.0


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_format_check_never_raises_and_needs_both_blocks(noise: str) -> None:
    step = text_step(noise, "ok")
    valid = step_format_valid(step, is_last=True)
    if valid:
        assert "<think>" in noise and ("<tool_call>" in noise or "<response>" in noise)


def test_composite_reward() -> None:
    assert composite_reward(1.0, 1.0, 0.5) == pytest.approx(0.9)
    assert composite_reward(0.5, 0.0, 1.0) == pytest.approx(0.1)
    assert composite_reward(0.0, 1.0, 1.0) == 0.0
    assert composite_reward(1.0, 1.0, 0.0, alpha=0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="alpha"):
        RewardConfig(alpha=1.2)


class SpyAccuracy:
    def __init__(self, verdict: Verdict | Exception = Verdict(1.0)) -> None:
        self.verdict, self.calls, self.lock = verdict, [], threading.Lock()

    def judge_answer(self, prompt, response):
        with self.lock:
            self.calls.append(response)
        if isinstance(self.verdict, Exception):
            raise self.verdict
        return self.verdict


class SpyQuery:
    def __init__(self, verdict: Verdict = Verdict(0.5)) -> None:
        self.verdict, self.calls, self.lock = verdict, [], threading.Lock()

    def judge_queries(self, prompt, steps):
        with self.lock:
            self.calls.append(list(steps))
        return self.verdict


def test_non_fatal_trajectory_is_judged_in_full() -> None:
    acc, query = SpyAccuracy(), SpyQuery()
    traj = trajectory(["ok", "tool_error", "ok"], answer="1982")
    out = score_trajectory(traj, acc, query)
    assert out.fatal_step == -1 and acc.calls == ["1982"] and query.calls == [traj.steps]
    assert out.reward.fmt == pytest.approx(3 / 4)  # the tool_error step is invalid
    assert out.reward.total == pytest.approx(0.75 * (0.8 * 1.0 + 0.2 * 0.5))
    assert traj.reward is None  # the input is not mutated


def test_fatal_trajectory_gets_zero_accuracy_and_prefix_only_process_rewards() -> None:
    acc, query = SpyAccuracy(), SpyQuery()
    traj = trajectory(["ok", "tool_error", "timeout", "parse_error", "ok"], answer="1982")
    out = score_trajectory(traj, acc, query)
    assert out.fatal_step == 3
    assert acc.calls == []  # no creditable answer: 0 by rule, no judge asked
    assert query.calls == [traj.steps[:3]]
    assert out.reward.acc == 0.0 and out.reward.fmt == pytest.approx(1 / 3)
    assert out.reward.total == pytest.approx((1 / 3) * 0.2 * 0.5)
    onset = score_trajectory(traj, acc, query, RewardConfig(fatal=FatalConfig(anchor="onset")))
    assert onset.fatal_step == 1 and query.calls[-1] == traj.steps[:1]
    assert onset.reward.fmt == 1.0


def test_trajectory_without_response_is_fatal_at_end() -> None:
    acc, query = SpyAccuracy(), SpyQuery()
    traj = trajectory(["ok", "ok"], answer=None)
    out = score_trajectory(traj, acc, query)
    assert out.fatal_step == 2 and acc.calls == [] and query.calls == [traj.steps]
    assert out.reward.acc == 0.0 and out.reward.total == pytest.approx(0.2 * 0.5)


def test_fatal_at_step_zero_scores_zero_without_judges() -> None:
    acc, query = SpyAccuracy(), SpyQuery()
    traj = trajectory(["tool_error"] * 3, answer=None, finish=FinishReason.FATAL)
    out = score_trajectory(traj, acc, query, RewardConfig(fatal=FatalConfig(anchor="onset")))
    assert out.fatal_step == 0 and acc.calls == [] and query.calls == []
    assert out.reward.scored and out.reward.total == 0.0 and out.reward.query == 0.0


def test_direct_answer_without_tools_gets_zero_query_by_rule() -> None:
    acc, query = SpyAccuracy(), SpyQuery()
    out = score_trajectory(trajectory([], answer="1982"), acc, query)
    assert query.calls == [] and out.reward.query == 0.0 and out.reward.total == pytest.approx(0.8)


def test_infra_error_is_unscored_without_judges() -> None:
    acc, query = SpyAccuracy(), SpyQuery()
    out = score_trajectory(trajectory(["ok", "infra_error"], answer="1982"), acc, query)
    assert acc.calls == [] and query.calls == []
    assert out.reward.total is None and out.reward.unscored_reason == "infra_error"


def test_kept_outage_rollouts_are_scored_and_the_fatal_rule_decides_their_mask() -> None:
    acc, query = SpyAccuracy(), SpyQuery()
    recovered = trajectory(["ok", "infra_error", "ok"], answer="1982")
    kept = score_trajectory(recovered, acc, query, RewardConfig(infra_rollouts="keep"))
    assert kept.reward.scored and acc.calls == ["1982"] and kept.fatal_step == -1
    assert kept.reward.fmt == 1.0  # an outage is not a format error of the policy's
    outage = trajectory(["ok", "infra_error", "infra_error", "infra_error"], answer=None, finish=FinishReason.FATAL)
    paper = RewardConfig(fatal=FatalConfig(errors="all"), infra_rollouts="keep")
    scored = score_trajectory(outage, acc, query, paper)
    assert scored.fatal_step == 3 and query.calls[-1] == outage.steps[:3]  # the good prefix and two failed calls
    assert scored.reward.acc == 0.0 and scored.reward.total == pytest.approx(0.2 * 0.5)
    policy_only = score_trajectory(outage, acc, query, RewardConfig(infra_rollouts="keep"))
    assert policy_only.fatal_step == 4 and policy_only.reward.scored  # no cascade: fatal at its end (no answer)
    engine_down = trajectory(["ok"], answer=None, finish=FinishReason.INFRA_ERROR)
    assert score_trajectory(engine_down, acc, query, paper).reward.unscored_reason == "infra_error"
    with pytest.raises(ValueError, match="infra_rollouts"):
        RewardConfig(infra_rollouts="sometimes")


def test_unscored_verdict_marks_sample_unscored_not_zero() -> None:
    out = score_trajectory(trajectory(["ok"]), SpyAccuracy(Verdict(None, "timeout")), SpyQuery())
    assert out.reward.total is None and out.reward.acc is None
    assert out.reward.unscored_reason == "accuracy:timeout" and out.reward.query == 0.5
    both = score_trajectory(
        trajectory(["ok"]), SpyAccuracy(Verdict(None, "http_401")), SpyQuery(Verdict(None, "http_503"))
    )
    assert both.reward.unscored_reason == "accuracy:http_401; query:http_503"


def test_judge_exception_becomes_unscored() -> None:
    out = score_trajectory(trajectory(["ok"]), SpyAccuracy(RuntimeError("boom")), SpyQuery())
    assert out.reward.total is None
    assert out.reward.unscored_reason == "accuracy:judge_exception:RuntimeError: boom"


def test_score_batch_keeps_order_and_length() -> None:
    batch = [trajectory(["ok"] * (i % 3), answer="1982" if i % 2 else None, sample_index=i) for i in range(17)]
    out = score_batch(batch, SpyAccuracy(), SpyQuery(), max_workers=4)
    assert [t.sample_index for t in out] == list(range(17))
    assert all(t.reward is not None for t in out)
    with pytest.raises(ValueError, match="max_workers"):
        score_batch(batch, SpyAccuracy(), SpyQuery(), max_workers=0)


def test_tool_step_helper_is_well_formed() -> None:
    assert step_format_valid(tool_step("ok"), is_last=False)
