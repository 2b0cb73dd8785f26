"""The mechanism behind Table 3b, exactly: where each fatal mode pushes the tool-call decision of a
toy agent under back-end outages, with the real scorer, the real advantages and the real fused loss."""

from __future__ import annotations

import math

import pytest
import torch

from osvl.rl.advantages import MODES
from osvl.study.mechanism import (
    CALL,
    ToyAgent,
    enumerate_rollouts,
    expected_advantages,
    expected_push,
    loss_gradient,
    pack,
    push_markdown,
    push_table,
    scored_rollouts,
    sequence_inputs,
)

AGENT = ToyAgent()  # P(call) = 0.88: a policy that SFT taught to use its tools
RATES = (0.0, 0.2, 0.4)


@pytest.fixture(scope="module")
def paper():
    """fatal_errors = all, infra_rollouts = keep: outages count toward the K-consecutive rule."""
    return {(p.outage_rate, p.mode): p for p in push_table(AGENT, RATES, [("all", "keep")])}


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("errors", ["policy", "all"])
def test_every_rollout_is_enumerated_with_its_probability(rate, errors):
    rollouts = enumerate_rollouts(AGENT, rate, errors)
    p = AGENT.call_probability
    assert math.isclose(sum(r.probability for r in rollouts), 1.0, abs_tol=1e-12)
    assert math.isclose(sum(r.probability for r in rollouts if r.actions == (0,)), 1 - p, rel_tol=1e-12)
    # an outage from turn 0 meets every rollout that calls at once: (rate / start turns) of them
    first_call_down = sum(r.probability for r in rollouts if r.statuses[:1] == ("infra_error",))
    assert math.isclose(first_call_down, p * rate / AGENT.outage_start_turns, rel_tol=1e-12, abs_tol=1e-15)
    assert all(len(r.actions) <= AGENT.max_turns for r in rollouts)
    if rate == 0.0:
        assert all("infra_error" not in r.statuses for r in rollouts)


def test_without_outages_nothing_is_fatal_and_the_modes_agree_that_tools_help(paper):
    pushes = [paper[0.0, mode] for mode in MODES]
    assert all(p.fatal_share == 0.0 and p.excluded_share == 0.0 for p in pushes)
    assert all(math.isclose(p.on_logit, pushes[0].on_logit, rel_tol=1e-9) for p in pushes)
    assert pushes[0].on_logit > 0  # answering from two lookups beats guessing: GRPO raises P(call)


@pytest.mark.parametrize("rate", [0.2, 0.4])
def test_under_outages_the_modes_order_as_the_paper_argues(paper, rate):
    vanilla, hard, mask, clamp = (paper[rate, m] for m in ("vanilla", "hard_mask", "fatal_mask", "fatal_clamp"))
    assert vanilla.fatal_share > 0.1
    # vanilla pushes the outage-hit rollouts' calls down, the sound prefix and the suffix alike
    assert vanilla.from_fatal < mask.from_fatal < 0.0
    assert hard.from_fatal == 0.0  # dropped whole
    assert clamp.from_fatal >= 0.0  # negative advantages zeroed, positive ones kept
    assert vanilla.on_probability < mask.on_probability < hard.on_probability <= clamp.on_probability


def test_vanilla_unlearns_tool_use_as_outages_grow_and_the_clamp_holds_it(paper):
    vanilla = [paper[r, "vanilla"].on_probability for r in RATES]
    clamp = [paper[r, "fatal_clamp"].on_probability for r in RATES]
    assert vanilla[0] > vanilla[1] > vanilla[2] > 0
    assert clamp[0] > clamp[1] > clamp[2]
    # at 40% outages vanilla's push on tool use is under 60% of its clean value; the clamp keeps over 80%
    assert vanilla[2] / vanilla[0] < 0.6 and clamp[2] / clamp[0] > 0.8


def test_dropping_outage_hit_rollouts_leaves_nothing_for_the_modes_to_differ_on():
    pushes = [expected_push(AGENT, 0.4, mode, "policy", "drop") for mode in MODES]
    assert all(p.fatal_share == 0.0 and p.excluded_share > 0.3 for p in pushes)
    assert all(math.isclose(p.on_logit, pushes[0].on_logit, rel_tol=1e-9) for p in pushes)


def test_counting_only_policy_errors_leaves_outage_rollouts_unmasked():
    """An outage never breaches the policy-only rule: the rollout runs out of turns, fatal at its end
    with nothing masked, so fatal masking is vanilla there and only the clamp protects the calls."""
    vanilla, mask, clamp = (
        expected_push(AGENT, 0.4, m, "policy", "keep") for m in ("vanilla", "fatal_mask", "fatal_clamp")
    )
    assert math.isclose(vanilla.on_logit, mask.on_logit, rel_tol=1e-9) and vanilla.from_fatal < 0
    assert clamp.on_probability > vanilla.on_probability


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_expected_advantages_are_exact(estimator):
    """RLOO's advantage has mean zero over the group distribution, exactly; the clamp only adds."""
    agent = ToyAgent(estimator=estimator)
    scored = scored_rollouts(agent, 0.4, "all", "keep")
    keys = sorted({(reward, step >= 0, reason) for _, reward, step, reason in scored}, key=str)
    probability = [
        sum(r.probability for r, reward, step, reason in scored if (reward, step >= 0, reason) == k) for k in keys
    ]
    plain = expected_advantages(keys, probability, "vanilla", agent)
    clamped = expected_advantages(keys, probability, "fatal_clamp", agent)
    mean = sum(p * a for p, a in zip(probability, plain))
    if estimator == "rloo":  # to the fp32 precision of the advantages
        assert abs(mean) < 1e-6 * sum(p * abs(a) for p, a in zip(probability, plain))
    fatal = [i for i, k in enumerate(keys) if k[1]]
    assert fatal and all(clamped[i] >= plain[i] for i in fatal) and any(clamped[i] > plain[i] for i in fatal)
    assert all(clamped[i] == pytest.approx(plain[i]) for i in range(len(keys)) if i not in fatal)


@pytest.mark.parametrize("mode", MODES)
def test_both_fused_losses_give_the_closed_form_gradient(mode):
    """grpo_loss and linear_grpo_loss against sum_seq A_seq sum_{kept decisions} -(1[call] - p) in float64."""
    rollouts, advantages, fatal_steps, _, _ = sequence_inputs(AGENT, 0.4, mode)
    packed = pack(rollouts)
    p = AGENT.call_probability
    expected = 0.0
    for index, rollout in enumerate(rollouts):
        for step, (action, decision) in enumerate(zip(rollout.actions, rollout.decisions)):
            masked = 0 <= int(fatal_steps[index]) <= step
            if decision and not masked:
                expected -= float(advantages[index]) * ((action == CALL) - p)
    linear = loss_gradient(packed, advantages, fatal_steps, AGENT.call_logit, "linear")
    logits = loss_gradient(packed, advantages, fatal_steps, AGENT.call_logit, "logits")
    assert linear == pytest.approx(expected, rel=1e-5)  # the kernels compute in fp32
    assert logits == pytest.approx(expected, rel=1e-5)
    if mode in ("fatal_mask", "fatal_clamp"):
        assert (fatal_steps >= 0).any()  # the mask really is exercised


def test_the_table_reads_and_bad_settings_are_refused():
    text = push_markdown(push_table(AGENT, (0.0, 0.4), [("all", "keep")]), AGENT)
    assert "| fatal_clamp |" in text and "outage 0.4" in text and "P(call) = 0.88" in text
    with pytest.raises(ValueError, match="unknown fatal mode"):
        expected_push(AGENT, 0.2, "soft_mask")
    with pytest.raises(ValueError, match="outage_rate"):
        enumerate_rollouts(AGENT, 1.5, "all")
    with pytest.raises(ValueError, match="max_turns > hops"):
        ToyAgent(hops=3, max_turns=3)
    with pytest.raises(ValueError, match="kernel"):
        loss_gradient(
            pack(enumerate_rollouts(AGENT, 0.0, "all")),
            torch.zeros(5, dtype=torch.float64),
            torch.full((5,), -1),
            0.0,
            "triton",
        )
