"""Fatal-step detection: where a cascade of tool-execution errors makes a rollout meaningless.

A counter runs over the steps (paper Eq. 19-20): +1 on a counted error, reset to 0 on an ``ok``
tool step; ``None`` (a step without a tool call) neither counts nor resets. Which errors count is
``errors``:

* ``"policy"`` (default): the policy's own errors (``tool_error``, ``parse_error``,
  ``invalid_arguments``, ``timeout``); ``infra_error`` (a back-end down, a worker crash) neither
  counts nor resets, and a rollout that met one is dropped whole (``infra_rollouts = "drop"``).
* ``"all"`` (the paper's "cascading tool-execution failures"; its release counts the statuses
  "unknown" and "error"): ``infra_error`` counts too, so an outage that starts mid-rollout makes
  it fatal from the cascade on while its good prefix keeps its gradient.
* ``"execution"``: only calls that reached a tool and failed there (``tool_error``, ``timeout``);
  the policy's unparsable or invalid calls (``parse_error``, ``invalid_arguments``) and
  ``infra_error`` neither count nor reset, and a rollout that ends without a response is not fatal.
  Nothing the policy writes alone makes its rollout fatal. Under the other two, the one-sided clamp
  protects a rollout the policy ends on purpose: in the demo, GRPO with 10% injected faults learnt
  to answer a failed call with two unparsable turns (a counted cascade, an advantage never below
  zero) instead of making the call again, and its fatal rate rose from 0.03 to 0.17 (first and last
  6 of 24 steps; docs/demo.md, "Tool faults").

The rollout is fatal once the counter reaches ``k``. The returned index is the first *masked* step:
tokens of that step and of every later step get no gradient, and the fatal trajectory's advantage is clamped at zero.

Two anchors place that index:

* ``"breach"`` (paper Eq. 20, default): the step at which the counter reaches ``k``.
* ``"onset"`` (official release): the first error of the cascade that reached ``k``.

Worked example, ``k=3``::

    step      0    1           2    3            4            5        6
    status    ok   tool_error  ok   parse_error  infra_error  timeout  tool_error
    counter   0    1           0    1            1            2        3

The counter reaches 3 at step 6, so ``breach`` -> 6; the cascade began at step 3 (the first error
after the last reset), so ``onset`` -> 3. The error at step 1 was
recovered from and is never masked. A rollout whose first three steps all fail is fatal at
step 0 under ``onset`` (nothing to learn from, yet it still counts in its group's statistics)
and at step 2 under ``breach``.

Rollouts that stop without a ``<response>`` (turn or token budget) are fatal *at their end*:
``fatal_step == len(steps)`` masks nothing but marks them fatal, so the one-sided clamp applies.
Where a rollout that met an ``infra_error`` goes is ``infra_rollouts``: ``"drop"`` retries it or
leaves it out of the loss and of its group's statistics, never scored; ``"keep"`` scores it like
any other (the fatal rule decides its mask). A rollout our engine or deadline cut short
(``FinishReason.INFRA_ERROR``) is dropped either way: there is no rollout to learn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from osvl.rl.trajectory import POLICY_ERRORS, FinishReason, Step, ToolStatus, Trajectory

FatalAnchor = Literal["breach", "onset"]
FatalErrors = Literal["policy", "all", "execution"]
InfraRollouts = Literal["drop", "keep"]
ANCHORS: tuple[str, ...] = ("breach", "onset")
FATAL_ERRORS: tuple[str, ...] = ("policy", "all", "execution")
INFRA_ROLLOUTS: tuple[str, ...] = ("drop", "keep")
NOT_FATAL = -1

_COUNTED = {
    "policy": POLICY_ERRORS,
    "all": POLICY_ERRORS | {ToolStatus.INFRA_ERROR},
    "execution": frozenset({ToolStatus.TOOL_ERROR, ToolStatus.TIMEOUT}),
}


@dataclass(frozen=True)
class FatalConfig:
    """How fatal steps are found: ``k`` consecutive counted errors (``errors``: the policy's, or
    every tool-execution failure), anchored at breach or onset."""

    k: int = 3
    anchor: FatalAnchor = "breach"
    errors: FatalErrors = "policy"

    def __post_init__(self) -> None:
        _check_rule(self.k, self.anchor, self.errors)


def _check_rule(k: int, anchor: str, errors: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if anchor not in ANCHORS:
        raise ValueError(f"unknown fatal anchor {anchor!r}; expected one of: {', '.join(ANCHORS)}")
    if errors not in FATAL_ERRORS:
        raise ValueError(f"unknown fatal errors {errors!r}; expected one of: {', '.join(FATAL_ERRORS)}")


def find_fatal_step(
    statuses: Sequence[ToolStatus | str | None],
    k: int = 3,
    anchor: FatalAnchor = "breach",
    errors: FatalErrors = "policy",
) -> int:
    """0-based index of the first masked step, or -1 when the cascade never reaches ``k``.

    ``statuses`` holds one ``ToolResult.status`` per step (``None`` for a step without a tool
    call); ``errors`` says which failures count. See the module docstring for the rule and a
    worked example of both anchors.
    """
    _check_rule(k, anchor, errors)
    counted = _COUNTED[errors]
    counter = 0
    onset = NOT_FATAL
    for index, raw in enumerate(statuses):
        if raw is None:
            continue
        status = ToolStatus.parse(raw)
        if status is ToolStatus.OK:
            counter = 0
        elif status in counted:
            if counter == 0:
                onset = index
            counter += 1
            if counter == k:
                return index if anchor == "breach" else onset
    return NOT_FATAL


def ended_with_response(steps: Sequence[Step]) -> bool:
    return bool(steps) and steps[-1].response is not None


def has_infra_error(traj: Trajectory) -> bool:
    """True when our infrastructure failed during the rollout (the engine, the deadline, a tool's back-end)."""
    return traj.finish_reason is FinishReason.INFRA_ERROR or any(
        status is ToolStatus.INFRA_ERROR for status in traj.statuses
    )


def infra_excluded(traj: Trajectory, infra_rollouts: InfraRollouts = "drop") -> bool:
    """Whether the rollout is retried or dropped, never scored: always when the engine or the deadline
    cut it short; for a tool's ``infra_error`` only under ``infra_rollouts = "drop"``."""
    if infra_rollouts not in INFRA_ROLLOUTS:
        raise ValueError(f"unknown infra_rollouts {infra_rollouts!r}; expected one of: {', '.join(INFRA_ROLLOUTS)}")
    if traj.finish_reason is FinishReason.INFRA_ERROR:
        return True
    return infra_rollouts == "drop" and has_infra_error(traj)


def trajectory_fatal_step(traj: Trajectory, config: FatalConfig = FatalConfig()) -> int:
    """Fatal step of a whole rollout: the error cascade if any, else its end if it has no response
    (not under ``errors = "execution"``: there only the tools' failures make a rollout fatal).

    Returns -1 for a non-fatal rollout and ``len(traj.steps)`` for one that ran out of turns or
    tokens (fatal, nothing masked).
    """
    cascade = find_fatal_step(traj.statuses, k=config.k, anchor=config.anchor, errors=config.errors)
    if cascade != NOT_FATAL or config.errors == "execution":
        return cascade
    return NOT_FATAL if ended_with_response(traj.steps) else len(traj.steps)


def is_fatal(fatal_step: int) -> bool:
    return fatal_step != NOT_FATAL


def valid_prefix(steps: Sequence[Step], fatal_step: int) -> Sequence[Step]:
    """The steps that keep their gradient (all of them for a non-fatal rollout)."""
    return steps if fatal_step == NOT_FATAL else steps[:fatal_step]
