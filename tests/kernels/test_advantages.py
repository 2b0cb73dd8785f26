"""group_advantages: estimators, std conventions, the one-sided fatal clamp (examples + properties)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from osvl_kernels import group_advantages
from osvl_kernels.reference import reference_advantages


def test_grpo_zscore_of_a_group_with_a_fatal_member():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    fatal = torch.tensor([False, True, False, False])
    adv = group_advantages(r, torch.zeros(4, dtype=torch.long), fatal, eps=0.0)
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in [1, 0, 0, 1]) / 3)
    expected = torch.tensor([0.5 / sd, 0.0, -0.5 / sd, 0.5 / sd])  # fatal -0.5/sd clamped to 0
    torch.testing.assert_close(adv, expected)


def test_fatal_members_still_count_in_group_statistics():
    r = torch.tensor([0.0, 1.0, 0.4])
    gid = torch.zeros(3, dtype=torch.long)
    with_fatal = group_advantages(r, gid, torch.tensor([True, False, False]), estimator="drgrpo")
    # mean includes the fatal member's reward (0.0): mean = 0.4667
    torch.testing.assert_close(with_fatal, torch.tensor([0.0, 1.0 - 1.4 / 3, 0.4 - 1.4 / 3]))


def test_rloo_is_reward_minus_mean_of_the_others():
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.75])
    gid = torch.tensor([7, 7, 7, 3, 3])
    adv = group_advantages(r, gid, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.75, 0.0, -0.5, 0.5]))


def test_group_of_one_gets_zero_even_when_unbiased_std_is_undefined():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1]), estimator="grpo")
    assert adv[0].item() == 0.0
    assert torch.isfinite(adv).all()


def test_population_and_unbiased_std_differ_by_sqrt_n_over_n_minus_1():
    r = torch.tensor([0.0, 1.0, 1.0, 0.0])
    gid = torch.zeros(4, dtype=torch.long)
    unbiased = group_advantages(r, gid, std="unbiased", eps=0.0)
    population = group_advantages(r, gid, std="population", eps=0.0)
    torch.testing.assert_close(population / unbiased, torch.full((4,), math.sqrt(4 / 3)))


def test_identical_rewards_give_zero_advantage_not_nan():
    adv = group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), eps=1e-6)
    assert torch.equal(adv, torch.zeros(4))


def test_clamp_can_be_disabled():
    r = torch.tensor([0.0, 1.0])
    fatal = torch.tensor([True, False])
    adv = group_advantages(r, torch.zeros(2, dtype=torch.long), fatal, estimator="drgrpo", clamp_fatal=False)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]))


def test_blocked_equality_matrix_handles_many_sequences():
    torch.manual_seed(0)
    S = 5000  # larger than one block of rows
    r = torch.rand(S)
    gid = torch.randint(0, 300, (S,))
    adv = group_advantages(r, gid, estimator="drgrpo")
    means = torch.zeros(300).index_add_(0, gid, r) / torch.bincount(gid, minlength=300).clamp_min(1)
    counts = torch.bincount(gid, minlength=300)[gid]
    expected = torch.where(counts > 1, r - means[gid], torch.zeros_like(r))
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(estimator="ppo"), "unknown estimator"),
        (dict(std="sample"), "unknown std"),
        (dict(eps=-1.0), "adv_eps"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(torch.rand(4), torch.zeros(4, dtype=torch.long), **kwargs)


@pytest.mark.parametrize(
    "rewards, group_ids, is_fatal, message",
    [
        (torch.rand(4, 1), torch.zeros(4, dtype=torch.long), None, "1-D"),
        (torch.arange(4), torch.zeros(4, dtype=torch.long), None, "floating"),
        (torch.rand(4), torch.zeros(3, dtype=torch.long), None, "group_ids shape"),
        (torch.rand(4), torch.zeros(4), None, "integer"),
        (torch.rand(4), torch.zeros(4, dtype=torch.long), torch.zeros(4), "bool"),
    ],
)
def test_bad_tensors_raise(rewards, group_ids, is_fatal, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_ids, is_fatal)


groups = st.lists(
    st.tuples(
        st.integers(0, 5),  # group id
        st.floats(-5, 5, allow_nan=False, width=32),  # reward
        st.booleans(),  # fatal
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(groups, st.sampled_from(["grpo", "rloo", "drgrpo"]), st.sampled_from(["unbiased", "population"]))
def test_matches_reference_and_clamp_rules(rows, estimator, std):
    gid = torch.tensor([g for g, _, _ in rows])
    r = torch.tensor([x for _, x, _ in rows], dtype=torch.float32)
    fatal = torch.tensor([f for _, _, f in rows])
    adv = group_advantages(r, gid, fatal, estimator=estimator, std=std)
    unclamped = group_advantages(r, gid, fatal, estimator=estimator, std=std, clamp_fatal=False)
    expected = reference_advantages(r.double().tolist(), gid.tolist(), fatal.tolist(), estimator=estimator, std=std)
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    # Clamp rules: fatal sequences are never negative; non-fatal ones are untouched by the clamp;
    # fatal ones are exactly max(unclamped, 0).
    assert (adv[fatal] >= 0).all()
    assert torch.equal(adv[~fatal], unclamped[~fatal])
    assert torch.equal(adv[fatal], unclamped[fatal].clamp_min(0))
    # Centering: the unclamped drgrpo/grpo scores of each multi-member group sum to ~0.
    if estimator != "rloo":
        for g in gid.unique():
            members = gid == g
            if members.sum() > 1:
                assert abs(unclamped[members].double().sum().item()) < 1e-3 * max(1.0, members.sum().item())


@settings(max_examples=60, deadline=None)
@given(groups)
def test_advantages_do_not_depend_on_group_id_values_or_order(rows):
    gid = torch.tensor([g for g, _, _ in rows])
    r = torch.tensor([x for _, x, _ in rows], dtype=torch.float32)
    fatal = torch.tensor([f for _, _, f in rows])
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(len(rows)))
    base = group_advantages(r, gid, fatal)
    relabeled = group_advantages(r[perm], gid[perm] * 1000 + 17, fatal[perm])
    torch.testing.assert_close(relabeled, base[perm])
