"""Where each fatal mode pushes the tool-use decision, computed exactly (no training run).

A toy agent answers a question whose answer takes ``hops`` successful tool calls to find. While it
does not know the answer it decides, at every turn, to call the tool (probability ``sigmoid(theta)``)
or to answer now (right with probability ``guess``); once it knows, it answers (not a decision).
A back-end outage hits a rollout with probability ``outage_rate`` from a turn drawn uniformly in
``[0, outage_start_turns)`` to its end (``osvl.tools.faults.OutageModel``): every call then
fails with ``infra_error``.

Every rollout the policy can produce is enumerated with its probability and scored by the real
code: ``osvl.rl.rewards.score_trajectory`` (fatal rule, format and prefix-only query rewards, the
``infra_rollouts`` choice) and ``osvl.rl.advantages.compute_advantages`` (the four modes). A
rollout's advantage depends on its group only through the other members' scores, so the exact
expected advantage of each outcome is a finite sum over the compositions of the other G-1 members.
The expected gradient on ``theta`` is then one call of the real fused loss
(``osvl_kernels.linear_grpo_loss``; ``grpo_loss`` agrees): every rollout is one packed sequence, a
decision is a token over the two actions (logits ``[0, theta]``), an observation is a token the
loss mask hides, and the sequence's advantage is its probability times its expected advantage, so
the fatal mask, the hard mask and the clamp act exactly as in training.

With no outage nothing is fatal and the four modes push alike. Under outages counted as fatal
(``fatal_errors = "all"``), a rollout that chose to call and then met the outage is fatal with a
low reward: vanilla GRPO pushes its calls (the sound prefix and the post-fatal suffix) down;
fatal masking spares the suffix but still pushes the prefix down; hard masking drops the rollout;
the clamp drops its negative advantage and keeps a positive one. See ``docs/ablation.md``.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from osvl.rl.advantages import DROP_INFRA, DROP_UNSCORED, MODES, AdvantageConfig, compute_advantages
from osvl.rl.fatal import FatalConfig, FatalErrors, InfraRollouts, find_fatal_step
from osvl.rl.judges import Verdict
from osvl.rl.offline_judges import ExactMatchAccuracyJudge
from osvl.rl.rewards import INFRA_UNSCORED, RewardConfig, score_trajectory
from osvl.rl.trajectory import FinishReason, Prompt, Step, ToolCall, ToolResult, Trajectory
from osvl_kernels import grpo_loss, linear_grpo_loss

CALL, ANSWER = 1, 0  # token ids of the two actions
_PROMPT = Prompt(id="toy", question="What is the answer two lookups away?", answer="right")
_CALL_TEXT = '<think>look it up</think>\n<tool_call>{"name": "text_search", "arguments": {"query": "hop"}}</tool_call>'
_KNOWN = -30.0  # logit of calling once the answer is known: the answer is then not a decision


@dataclass(frozen=True)
class ToyAgent:
    """The toy task and policy; ``group_size`` and ``estimator`` are the study's (``tiny_grpo``)."""

    call_logit: float = 2.0  # theta: log-odds of calling while the answer is unknown (0.88: an SFT'd tool user)
    hops: int = 2
    max_turns: int = 5
    guess: float = 0.1  # accuracy of an answer given before the hops are done
    outage_start_turns: int = 2
    alpha: float = 0.8
    k: int = 3
    group_size: int = 4
    estimator: str = "rloo"

    def __post_init__(self) -> None:
        valid = self.hops >= 1 and self.max_turns > self.hops and self.outage_start_turns >= 1
        if not (valid and self.group_size >= 2):
            raise ValueError(f"need hops >= 1, max_turns > hops, outage_start_turns >= 1, group_size >= 2: {self}")
        if not 0.0 <= self.guess <= 1.0:
            raise ValueError(f"guess must lie in [0, 1], got {self.guess}")

    @property
    def call_probability(self) -> float:
        return 1.0 / (1.0 + math.exp(-self.call_logit))


@dataclass(frozen=True)
class ToyRollout:
    """One rollout the toy policy can produce: per turn its action, whether it was a decision, the
    tool status; and the probability of the whole rollout."""

    actions: tuple[int, ...]
    decisions: tuple[bool, ...]
    statuses: tuple[str | None, ...]
    answer: str | None
    finish: FinishReason
    probability: float


@dataclass(frozen=True)
class Push:
    """Expected gradient-descent step direction on ``theta`` (per unit learning rate) and on the call
    probability, with the share of rollouts that are fatal and that are left out."""

    mode: str
    errors: str
    infra_rollouts: str
    outage_rate: float
    on_logit: float
    on_probability: float
    from_fatal: float  # the part of on_probability that the fatal rollouts contribute
    fatal_share: float
    excluded_share: float


def enumerate_rollouts(agent: ToyAgent, outage_rate: float, errors: FatalErrors) -> list[ToyRollout]:
    """Every rollout with its probability (they sum to 1). Under ``errors = "all"`` the agent loop
    stops a rollout at its K-th consecutive counted error, as ``osvl.rollout.agent`` does."""
    if not 0.0 <= outage_rate <= 1.0:
        raise ValueError(f"outage_rate must lie in [0, 1], got {outage_rate}")
    windows = [(None, 1.0 - outage_rate)] + [
        (s, outage_rate / agent.outage_start_turns) for s in range(agent.outage_start_turns)
    ]
    out = []
    for start, weight in windows:
        if weight > 0.0:
            out += _branches(agent, start, errors, (), (), (), 0, weight)
    return out


def _branches(
    agent: ToyAgent,
    start: int | None,
    errors: FatalErrors,
    actions: tuple,
    decisions: tuple,
    statuses: tuple,
    found: int,
    probability: float,
) -> Iterator[ToyRollout]:
    turn = len(actions)
    if turn == agent.max_turns:
        yield ToyRollout(actions, decisions, statuses, None, FinishReason.MAX_TURNS, probability)
        return
    if found >= agent.hops:
        yield ToyRollout(
            actions + (ANSWER,), decisions + (False,), statuses + (None,), "right", FinishReason.RESPONSE, probability
        )
        return
    p = agent.call_probability
    for answer, chance in (("right", agent.guess), ("wrong", 1.0 - agent.guess)):
        if chance > 0.0:
            yield ToyRollout(
                actions + (ANSWER,),
                decisions + (True,),
                statuses + (None,),
                answer,
                FinishReason.RESPONSE,
                probability * (1.0 - p) * chance,
            )
    down = start is not None and turn >= start
    called = (actions + (CALL,), decisions + (True,), statuses + ("infra_error" if down else "ok",))
    if find_fatal_step(called[2], k=agent.k, errors=errors) != -1:
        yield ToyRollout(*called, None, FinishReason.FATAL, probability * p)
        return
    yield from _branches(agent, start, errors, *called, found + (not down), probability * p)


class HopQueryJudge:
    """The query-quality judge of the toy: the share of the needed hops the valid prefix found."""

    def __init__(self, hops: int) -> None:
        self.hops = hops

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        found = sum(s.tool_result is not None and s.tool_result.ok for s in steps)
        return Verdict(min(1.0, found / self.hops))


def as_trajectory(rollout: ToyRollout) -> Trajectory:
    """The rollout as the trainer records it (well-formed steps, typed tool results)."""
    steps = []
    for action, status in zip(rollout.actions, rollout.statuses):
        if action == CALL:
            result = ToolResult(
                status=status,
                tool="text_search",
                text="a fact" if status == "ok" else "",
                error=None if status == "ok" else "text_search back-end failed with HTTP 503",
            )
            steps.append(
                Step(
                    token_ids=[CALL],
                    logprobs=[0.0],
                    text=_CALL_TEXT,
                    tool_call=ToolCall("text_search", {"query": "hop"}),
                    tool_result=result,
                    observation_text=result.text or f"Error (infra_error): {result.error}",
                )
            )
        else:
            steps.append(
                Step(
                    token_ids=[ANSWER],
                    logprobs=[0.0],
                    response=rollout.answer,
                    text=f"<think>answer</think>\n<response>{rollout.answer}</response>",
                )
            )
    return Trajectory(prompt=_PROMPT, steps=steps, finish_reason=rollout.finish, group_id=0, sample_index=0)


@functools.lru_cache(maxsize=64)
def scored_rollouts(
    agent: ToyAgent, outage_rate: float, errors: FatalErrors, infra_rollouts: InfraRollouts
) -> tuple[tuple[ToyRollout, float | None, int, str | None], ...]:
    """Each rollout with its (reward, fatal step, exclusion) from the real scorer."""
    config = RewardConfig(alpha=agent.alpha, fatal=FatalConfig(k=agent.k, errors=errors), infra_rollouts=infra_rollouts)
    accuracy, query = ExactMatchAccuracyJudge(), HopQueryJudge(agent.hops)
    scored = []
    for rollout in enumerate_rollouts(agent, outage_rate, errors):
        traj = score_trajectory(as_trajectory(rollout), accuracy, query, config)
        reason = (
            None
            if traj.reward.scored
            else (DROP_INFRA if traj.reward.unscored_reason == INFRA_UNSCORED else DROP_UNSCORED)
        )
        scored.append((rollout, traj.reward.total, traj.fatal_step, reason))
    return tuple(scored)


Outcome = tuple[float | None, bool, str | None]  # (reward, fatal, exclusion): all a group's arithmetic sees


def expected_advantages(
    outcomes: Sequence[Outcome], probabilities: Sequence[float], mode: str, agent: ToyAgent
) -> list[float]:
    """E[advantage | own outcome] for each distinct outcome, by summing over every composition of the
    other G-1 group members (multinomial weights), with ``compute_advantages`` doing the arithmetic."""
    others = agent.group_size - 1
    compositions = list(itertools.combinations_with_replacement(range(len(outcomes)), others))
    weights = [
        math.factorial(others) * math.prod(probabilities[o] ** n / math.factorial(n) for o, n in Counter(rest).items())
        for rest in compositions
    ]
    config = AdvantageConfig(mode=mode, estimator=agent.estimator)
    expected = []
    for own in range(len(outcomes)):  # one batch per own outcome keeps the group arithmetic small
        members = [outcomes[o] for rest in compositions for o in (own, *rest)]
        groups = [g for g in range(len(compositions)) for _ in range(agent.group_size)]
        batch = compute_advantages(
            [m[0] for m in members], groups, [0 if m[1] else -1 for m in members], config, [m[2] for m in members]
        )
        first = batch.advantages[:: agent.group_size].double()  # member 0 of every group: the own outcome
        expected.append(float((first * torch.tensor(weights, dtype=torch.float64)).sum()))
    return expected


@dataclass(frozen=True)
class PackedRollouts:
    """Every rollout as one packed sequence: decision / answer tokens and hidden observation tokens."""

    hidden: torch.Tensor  # [T, 2]: (1, 0) a decision, (0, 1) an answer already known, (0, 0) an observation
    targets: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T]
    token_step: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [S + 1]


def pack(rollouts: Sequence[ToyRollout]) -> PackedRollouts:
    hidden, targets, mask, steps, bounds = [], [], [], [], [0]
    for rollout in rollouts:
        for step, (action, decision) in enumerate(zip(rollout.actions, rollout.decisions)):
            hidden.append((1.0, 0.0) if decision else (0.0, 1.0))
            targets.append(action)
            mask.append(True)
            steps.append(step)
            if action == CALL:  # the observation: in the sequence, never in the loss
                hidden.append((0.0, 0.0))
                targets.append(ANSWER)
                mask.append(False)
                steps.append(step)
        bounds.append(len(targets))
    return PackedRollouts(
        torch.tensor(hidden, dtype=torch.float64),
        torch.tensor(targets),
        torch.tensor(mask),
        torch.tensor(steps),
        torch.tensor(bounds, dtype=torch.int32),
    )


def policy_weight(theta: float) -> torch.Tensor:
    """The lm_head of the toy: logits = hidden @ W.T, so row 1 column 0 is theta."""
    return torch.tensor([[0.0, 0.0], [theta, _KNOWN]], dtype=torch.float64, requires_grad=True)


def loss_gradient(
    packed: PackedRollouts, advantages: torch.Tensor, fatal_steps: torch.Tensor, theta: float, kernel: str = "linear"
) -> float:
    """d loss / d theta from the real loss, on-policy (ratio 1), summed over sequences (``num_seqs=1``)."""
    weight = policy_weight(theta)
    with torch.no_grad():
        old = torch.log_softmax(packed.hidden @ weight.T, dim=-1).gather(1, packed.targets[:, None]).squeeze(1)
    args = dict(
        old_logprobs=old,
        fatal_step=fatal_steps,
        token_step=packed.token_step,
        advantages=advantages,
        loss_agg="seq-mean-token-sum",
        num_seqs=1,
        backend="torch",
    )
    if kernel == "linear":
        out = linear_grpo_loss(packed.hidden, weight, packed.targets, packed.cu_seqlens, packed.loss_mask, **args)
    elif kernel == "logits":
        out = grpo_loss(packed.hidden @ weight.T, packed.targets, packed.cu_seqlens, packed.loss_mask, **args)
    else:
        raise ValueError(f"kernel must be 'linear' or 'logits', got {kernel!r}")
    out.loss.backward()
    return float(weight.grad[1, 0])


def sequence_inputs(
    agent: ToyAgent, outage_rate: float, mode: str, errors: FatalErrors = "all", infra_rollouts: InfraRollouts = "keep"
) -> tuple[list[ToyRollout], torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """The rollouts; each one's loss advantage (its probability x its expected advantage; 0 when the mode or
    the exclusion drops it) and loss fatal step; which are fatal; the fatal and left-out shares."""
    if mode not in MODES:
        raise ValueError(f"unknown fatal mode {mode!r}; expected one of: {', '.join(MODES)}")
    scored = scored_rollouts(agent, outage_rate, errors, infra_rollouts)
    rollouts = [r for r, _, _, _ in scored]
    keys = [(reward, step >= 0, reason) for _, reward, step, reason in scored]
    outcomes = sorted(set(keys), key=json.dumps)
    probability = {o: 0.0 for o in outcomes}
    for rollout, key in zip(rollouts, keys):
        probability[key] += rollout.probability
    per_outcome = dict(zip(outcomes, expected_advantages(outcomes, [probability[o] for o in outcomes], mode, agent)))
    masks_fatal = mode in ("fatal_mask", "fatal_clamp")
    advantages = torch.tensor([r.probability * per_outcome[k] for r, k in zip(rollouts, keys)], dtype=torch.float64)
    fatal_steps = torch.tensor([step if masks_fatal else -1 for _, _, step, _ in scored])
    fatal = torch.tensor([k[1] and k[2] is None for k in keys])
    shares = {
        "fatal": sum(probability[o] for o in outcomes if o[1] and o[2] is None),
        "excluded": sum(probability[o] for o in outcomes if o[2] is not None),
    }
    return rollouts, advantages, fatal_steps, fatal, shares


def expected_push(
    agent: ToyAgent,
    outage_rate: float,
    mode: str,
    errors: FatalErrors = "all",
    infra_rollouts: InfraRollouts = "keep",
    kernel: str = "linear",
) -> Push:
    """The exact expected descent direction on the tool-call logit (and probability) for one setting,
    in total and from the fatal rollouts alone."""
    rollouts, advantages, fatal_steps, fatal, shares = sequence_inputs(agent, outage_rate, mode, errors, infra_rollouts)
    packed = pack(rollouts)
    gradient = loss_gradient(packed, advantages, fatal_steps, agent.call_logit, kernel)
    from_fatal = loss_gradient(packed, torch.where(fatal, advantages, 0.0), fatal_steps, agent.call_logit, kernel)
    scale = agent.call_probability * (1.0 - agent.call_probability)
    return Push(
        mode,
        errors,
        infra_rollouts,
        outage_rate,
        -gradient,
        -gradient * scale,
        -from_fatal * scale,
        shares["fatal"],
        shares["excluded"],
    )


ERROR_CHOICES: tuple[tuple[str, str], ...] = (("all", "keep"), ("policy", "keep"), ("policy", "drop"))


def push_table(
    agent: ToyAgent = ToyAgent(),
    rates: Sequence[float] = (0.0, 0.2, 0.4),
    choices: Sequence[tuple[str, str]] = ERROR_CHOICES,
) -> list[Push]:
    """Every mode x outage rate x error choice."""
    return [
        expected_push(agent, rate, mode, errors, infra) for errors, infra in choices for rate in rates for mode in MODES
    ]


def push_markdown(pushes: Sequence[Push], agent: ToyAgent) -> str:
    """One table per error choice: rows are modes, columns outage rates (push on the call probability)."""
    lines = [
        f"Toy agent: {agent.hops} hops, {agent.max_turns} turns, guess accuracy {agent.guess}, "
        f"P(call) = {agent.call_probability:.2f}, G = {agent.group_size}, {agent.estimator}, K = {agent.k}, "
        f"outage from a turn in [0, {agent.outage_start_turns}) to the end. Entries: expected descent step on "
        "P(call) per unit learning rate (x1000; + = more tool use), and in brackets the part the fatal "
        "rollouts contribute."
    ]
    for errors, infra in dict.fromkeys((p.errors, p.infra_rollouts) for p in pushes):
        rows = [p for p in pushes if (p.errors, p.infra_rollouts) == (errors, infra)]
        rates = sorted({p.outage_rate for p in rows})
        lines += [
            "",
            f"fatal_errors = {errors}, infra_rollouts = {infra}:",
            "",
            "| mode | " + " | ".join(f"outage {r:g}" for r in rates) + " |",
            "|---|" + "---:|" * len(rates),
        ]
        for mode in MODES:
            cells = [next(p for p in rows if p.mode == mode and p.outage_rate == r) for r in rates]
            lines.append(
                f"| {mode} | "
                + " | ".join(f"{_milli(c.on_probability)} ({_milli(c.from_fatal)})" for c in cells)
                + " |"
            )
        shares = [next(p for p in rows if p.outage_rate == r) for r in rates]
        lines.append(
            "| share fatal / left out | "
            + " | ".join(f"{s.fatal_share:.0%} / {s.excluded_share:.0%}" for s in shares)
            + " |"
        )
    return "\n".join(lines)


def _milli(value: float) -> str:
    text = f"{1000 * value:+.2f}"
    return "0.00" if text in ("+0.00", "-0.00") else text
