"""Fatal-step rule: the paper's worked examples under both anchors, properties, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from osvl.rl import find_fatal_step
from osvl.rl.fatal import (
    FatalConfig,
    has_infra_error,
    infra_excluded,
    is_fatal,
    trajectory_fatal_step,
    valid_prefix,
)
from osvl.rl.trajectory import FinishReason, ToolStatus

from .helpers import trajectory

E, P, T, OK, INF = "tool_error", "parse_error", "timeout", "ok", "infra_error"

# (statuses, k, breach, onset)
WORKED_EXAMPLES = {
    "three consecutive errors": ([OK, E, P, T, OK], 3, 3, 1),
    "error, success, then errors": ([E, OK, E, E, E, None], 3, 4, 2),
    "error, success, then too few errors": ([E, OK, E, E, None], 3, -1, -1),
    "infra errors interleaved": ([E, INF, E, INF, INF, T], 3, 5, 0),
    "infra between does not reset": ([OK, E, E, INF, OK, E, E, INF, E], 3, 8, 5),
    "fatal at step 0 (onset)": ([E, P, T, None], 3, 2, 0),
    "fatal at step 0 (k=1)": ([T, OK], 1, 0, 0),
    "no tool call steps are neutral": ([E, None, E, None, E], 3, 4, 0),
    "docstring example": ([OK, E, OK, P, INF, T, E], 3, 6, 3),
    "k=2 first cascade wins": ([E, E, OK, E, E], 2, 1, 0),
    "all ok": ([OK, OK, None], 3, -1, -1),
    "empty": ([], 3, -1, -1),
    "only infra": ([INF, INF, INF, INF], 1, -1, -1),
}


@pytest.mark.parametrize("anchor", ["breach", "onset"])
@pytest.mark.parametrize("name", sorted(WORKED_EXAMPLES))
def test_worked_examples(name: str, anchor: str) -> None:
    statuses, k, breach, onset = WORKED_EXAMPLES[name]
    expected = breach if anchor == "breach" else onset
    assert find_fatal_step(statuses, k=k, anchor=anchor) == expected


def test_default_is_breach_with_k3() -> None:
    assert find_fatal_step([OK, E, E, E]) == 3
    assert find_fatal_step([OK, E, E]) == -1


def test_enum_statuses_accepted() -> None:
    statuses = [ToolStatus.TOOL_ERROR, ToolStatus.TIMEOUT, ToolStatus.PARSE_ERROR]
    assert find_fatal_step(statuses) == 2
    assert find_fatal_step(statuses, anchor="onset") == 0


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "3"])
def test_bad_k(k) -> None:
    with pytest.raises(ValueError, match="k must be"):
        find_fatal_step([E, E, E], k=k)


@pytest.mark.parametrize("anchor", ["start", "Breach", "", None])
def test_bad_anchor(anchor) -> None:
    with pytest.raises(ValueError, match="unknown fatal anchor"):
        find_fatal_step([E, E, E], anchor=anchor)
    with pytest.raises(ValueError, match="unknown fatal anchor"):
        FatalConfig(anchor=anchor)


def test_bad_status_names_the_value() -> None:
    with pytest.raises(ValueError, match="unknown tool status 'error'"):
        find_fatal_step([OK, "error"])


# --- properties ------------------------------------------------------------------------------

STATUS = st.sampled_from([OK, E, P, T, INF, None])


def reference_breach(statuses: list, k: int) -> int:
    """Independent formulation: first step whose k most recent counting statuses are all errors."""
    counting: list[tuple[int, str]] = [(i, s) for i, s in enumerate(statuses) if s not in (None, INF)]
    for j in range(k - 1, len(counting)):
        window = counting[j - k + 1 : j + 1]
        if all(s != OK for _, s in window):
            return counting[j][0]
    return -1


@settings(max_examples=150, deadline=None)
@given(statuses=st.lists(STATUS, max_size=20), k=st.integers(1, 5))
def test_breach_matches_sliding_window_reference(statuses, k) -> None:
    assert find_fatal_step(statuses, k=k) == reference_breach(statuses, k)


@settings(max_examples=150, deadline=None)
@given(statuses=st.lists(STATUS, max_size=20), k=st.integers(1, 5))
def test_onset_is_start_of_the_breaching_cascade(statuses, k) -> None:
    breach = find_fatal_step(statuses, k=k)
    onset = find_fatal_step(statuses, k=k, anchor="onset")
    assert (breach == -1) == (onset == -1)
    if breach == -1:
        return
    assert 0 <= onset <= breach < len(statuses)
    assert statuses[onset] in (E, P, T) and statuses[breach] in (E, P, T)
    between = statuses[onset : breach + 1]
    assert OK not in between
    assert sum(s in (E, P, T) for s in between) == k
    # the cascade starts right after the last ok (or at the first error of the trajectory)
    counting_before = [s for s in statuses[:onset] if s not in (None, INF)]
    assert not counting_before or counting_before[-1] == OK


@settings(max_examples=100, deadline=None)
@given(
    statuses=st.lists(STATUS, max_size=15),
    k=st.integers(1, 4),
    anchor=st.sampled_from(["breach", "onset"]),
    position=st.integers(0, 15),
    neutral=st.sampled_from([None, INF]),
)
def test_neutral_statuses_only_shift_indices(statuses, k, anchor, position, neutral) -> None:
    position = min(position, len(statuses))
    before = find_fatal_step(statuses, k=k, anchor=anchor)
    padded = statuses[:position] + [neutral] + statuses[position:]
    after = find_fatal_step(padded, k=k, anchor=anchor)
    if before == -1:
        assert after == -1
    else:
        assert after == before + (1 if position <= before else 0)


@settings(max_examples=100, deadline=None)
@given(statuses=st.lists(STATUS, max_size=15), k=st.integers(1, 4), neutral=st.sampled_from([None, INF]))
def test_ok_cuts_the_history(statuses, k, neutral) -> None:
    """k-1 errors followed by an ok leave no trace: the rest behaves as if it stood alone."""
    prefix = [E, neutral] * (k - 1)
    tail = [OK] + statuses
    for anchor in ("breach", "onset"):
        alone = find_fatal_step(tail, k=k, anchor=anchor)
        expected = -1 if alone == -1 else alone + len(prefix)
        assert find_fatal_step(prefix + tail, k=k, anchor=anchor) == expected


# --- trajectory helpers ----------------------------------------------------------------------


def test_response_trajectory_without_cascade_is_not_fatal() -> None:
    traj = trajectory([OK, E, OK])
    assert trajectory_fatal_step(traj) == -1
    assert not is_fatal(-1)
    assert valid_prefix(traj.steps, -1) == traj.steps


def test_no_response_is_fatal_at_end_masking_nothing() -> None:
    traj = trajectory([OK, E, OK], answer=None)
    step = trajectory_fatal_step(traj)
    assert step == len(traj.steps) == 3
    assert is_fatal(step)
    assert list(valid_prefix(traj.steps, step)) == traj.steps


def test_cascade_takes_precedence_over_end() -> None:
    traj = trajectory([OK, E, E, E, T], answer=None)
    assert trajectory_fatal_step(traj) == 3
    assert trajectory_fatal_step(traj, FatalConfig(anchor="onset")) == 1
    assert len(valid_prefix(traj.steps, 1)) == 1


def test_fatal_at_step_zero_has_empty_prefix() -> None:
    traj = trajectory([E, E, E], answer=None, finish=FinishReason.FATAL)
    step = trajectory_fatal_step(traj, FatalConfig(anchor="onset"))
    assert step == 0 and list(valid_prefix(traj.steps, step)) == []


def test_infra_error_flags() -> None:
    assert has_infra_error(trajectory([OK, INF, OK]))
    assert has_infra_error(trajectory([OK], finish=FinishReason.INFRA_ERROR))
    assert not has_infra_error(trajectory([OK, E, T]))


# --- which errors count: policy errors only, every tool-execution failure, or the tools' own ----

# errors choice -> {name: (statuses, k, breach, onset)}; under "policy" the lists follow WORKED_EXAMPLES.
# "all" counts infra errors too; "execution" only the tools' failures (tool_error, timeout): the policy's
# unparsable or invalid calls and infra errors neither count nor reset.
ERROR_CHOICES = {
    "all": {
        "an outage after a good call": ([OK, INF, INF, INF], 3, 3, 1),
        "outage and policy errors mix": ([OK, E, INF, T, OK], 3, 3, 1),
        "ok resets an outage": ([INF, INF, OK, INF, INF], 3, -1, -1),
        "only infra": ([INF, INF, INF, INF], 1, 0, 0),
        "infra interleaved": ([E, INF, E, INF, INF, T], 3, 2, 0),
    },
    "execution": {
        "a fault, then two unparsable turns": ([OK, E, P, P], 3, -1, -1),
        "three faults in a row": ([OK, E, E, T], 3, 3, 1),
        "unparsable turns neither count nor reset": ([E, P, E, "invalid_arguments", E], 3, 4, 0),
        "infra neither counts nor resets": ([E, INF, E, INF, E], 3, 4, 0),
        "ok resets": ([E, E, OK, E, E], 3, -1, -1),
    },
}


@pytest.mark.parametrize(
    ("errors", "name"), [(errors, name) for errors, cases in ERROR_CHOICES.items() for name in sorted(cases)]
)
def test_error_choices_count_their_errors(errors: str, name: str) -> None:
    statuses, k, breach, onset = ERROR_CHOICES[errors][name]
    assert find_fatal_step(statuses, k=k, errors=errors) == breach
    assert find_fatal_step(statuses, k=k, anchor="onset", errors=errors) == onset


def test_policy_errors_leave_an_outage_alone() -> None:
    assert find_fatal_step([OK, INF, INF, INF]) == -1
    assert find_fatal_step([OK, INF, INF, INF], errors="policy") == -1
    traj = trajectory([OK, INF, INF, INF], answer=None, finish=FinishReason.FATAL)
    assert trajectory_fatal_step(traj) == 4  # no response: fatal at its end, nothing masked
    assert trajectory_fatal_step(traj, FatalConfig(errors="all")) == 3


def test_unknown_error_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fatal errors 'infra'"):
        FatalConfig(errors="infra")
    with pytest.raises(ValueError, match="unknown fatal errors"):
        find_fatal_step([E, E, E], errors="everything")


def test_infra_rollouts_decide_what_is_excluded() -> None:
    outage = trajectory([OK, INF, OK])
    engine_down = trajectory([OK], finish=FinishReason.INFRA_ERROR)
    clean = trajectory([OK, E])
    assert infra_excluded(outage) and infra_excluded(outage, "drop") and not infra_excluded(outage, "keep")
    assert infra_excluded(engine_down, "keep") and infra_excluded(engine_down, "drop")  # no rollout to learn from
    assert not infra_excluded(clean, "drop") and not infra_excluded(clean, "keep")
    with pytest.raises(ValueError, match="unknown infra_rollouts 'retry'"):
        infra_excluded(clean, "retry")


def test_under_execution_errors_a_rollout_without_response_is_not_fatal() -> None:
    # the collapse GRPO learnt in the demo: a fault answered with unparsable turns until the rollout ends
    collapsed = trajectory([OK, E, P, P], answer=None, finish=FinishReason.FATAL)
    assert trajectory_fatal_step(collapsed) == 3  # "policy": a cascade, so the clamp protects it
    assert trajectory_fatal_step(collapsed, FatalConfig(errors="execution")) == -1
    out_of_turns = trajectory([OK, OK, OK], answer=None)
    assert trajectory_fatal_step(out_of_turns) == 3
    assert trajectory_fatal_step(out_of_turns, FatalConfig(errors="execution")) == -1
    faults = trajectory([OK, E, E, E], answer=None, finish=FinishReason.FATAL)
    assert trajectory_fatal_step(faults, FatalConfig(errors="execution")) == 3
