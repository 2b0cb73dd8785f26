"""Ablation modes over a scored batch, exclusion of unscored samples, and Figure 5 statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from osvl.rl import AdvantageConfig, batch_stats, compute_advantages, trajectory_advantages
from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.rewards import score_batch
from osvl.rl.trajectory import RewardParts

from .helpers import trajectory


def grpo(rewards: list[float], eps: float = 1e-6) -> np.ndarray:
    """Independent reference: (r - mean) / (unbiased std + eps); single-member group -> 0."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size < 2:
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=1) + eps)


# two groups: group 10 has a fatal winner-ish and a fatal loser; group 3 has a fatal at step 0
REWARDS = [0.9, 0.1, 0.6, 0.0, 0.5, 0.2, 0.0]
GROUPS = [10, 10, 10, 10, 3, 3, 3]
FATAL = [-1, 4, 2, -1, -1, 0, 5]


def expected_pre_clamp() -> np.ndarray:
    return np.concatenate([grpo(REWARDS[:4]), grpo(REWARDS[4:])])


@pytest.mark.parametrize("mode", ["vanilla", "hard_mask", "fatal_mask", "fatal_clamp"])
def test_modes(mode: str) -> None:
    batch = compute_advantages(REWARDS, GROUPS, FATAL, AdvantageConfig(mode=mode))
    pre = expected_pre_clamp()
    fatal = np.array(FATAL) != -1
    assert batch.mode == mode
    np.testing.assert_allclose(batch.pre_clamp.numpy(), pre, rtol=1e-6, atol=1e-6)
    assert batch.advantages.dtype == torch.float32 and batch.loss_fatal_steps.dtype == torch.int64
    assert batch.is_fatal.tolist() == fatal.tolist()
    assert batch.in_statistics.all()
    adv = batch.advantages.numpy()
    if mode == "vanilla":
        np.testing.assert_allclose(adv, pre, rtol=1e-6, atol=1e-6)
        assert batch.loss_fatal_steps.tolist() == [-1] * 7 and batch.keep.all()
    elif mode == "hard_mask":
        np.testing.assert_allclose(adv, np.where(fatal, 0.0, pre), rtol=1e-6, atol=1e-6)
        assert batch.keep.tolist() == (~fatal).tolist()
        assert batch.drop_reasons == tuple("hard_masked" if f else None for f in fatal)
    elif mode == "fatal_mask":
        np.testing.assert_allclose(adv, pre, rtol=1e-6, atol=1e-6)
        assert batch.loss_fatal_steps.tolist() == FATAL and batch.keep.all()
    else:
        np.testing.assert_allclose(adv, np.where(fatal, np.maximum(pre, 0.0), pre), rtol=1e-6, atol=1e-6)
        assert batch.loss_fatal_steps.tolist() == FATAL and batch.keep.all()
        assert adv[1] == 0.0 and adv[2] > 0.0  # the fatal loser is clamped, the fatal winner kept


def test_default_is_fatal_clamp() -> None:
    assert AdvantageConfig().mode == "fatal_clamp"


def test_fatal_at_step_zero_counts_in_group_statistics() -> None:
    with_it = compute_advantages(REWARDS[4:], GROUPS[4:], FATAL[4:])
    without = compute_advantages([REWARDS[4], REWARDS[6]], [3, 3], [FATAL[4], FATAL[6]])
    assert with_it.loss_fatal_steps[1] == 0 and with_it.keep[1]
    assert not torch.allclose(with_it.advantages[[0, 2]], without.advantages)
    np.testing.assert_allclose(with_it.pre_clamp.numpy(), grpo(REWARDS[4:]), rtol=1e-6, atol=1e-6)


def test_unscored_samples_are_left_out_of_their_group() -> None:
    rewards = [1.0, None, 0.0, 0.25, None]
    batch = compute_advantages(rewards, [0, 0, 0, 1, 1], [-1, -1, -1, -1, 3])
    assert batch.in_statistics.tolist() == [True, False, True, True, False]
    assert batch.keep.tolist() == [True, False, True, True, False]
    assert batch.drop_reasons == (None, "unscored", None, None, "unscored")
    np.testing.assert_allclose(batch.advantages.numpy()[[0, 2]], grpo([1.0, 0.0]), rtol=1e-6)
    assert batch.advantages[1] == 0.0 and batch.advantages[4] == 0.0
    assert batch.advantages[3] == 0.0  # its group has one scored member left


def test_exclusion_reasons_override_rewards() -> None:
    batch = compute_advantages([1.0, 0.0, 0.5], [0, 0, 0], [-1, -1, -1], exclusions=[None, "infra_error", None])
    assert batch.drop_reasons == (None, "infra_error", None)
    np.testing.assert_allclose(batch.advantages.numpy()[[0, 2]], grpo([1.0, 0.5]), rtol=1e-6)


def test_rloo_estimator_is_passed_through() -> None:
    batch = compute_advantages([1.0, 0.0, 0.5], [0, 0, 0], [-1, 2, -1], AdvantageConfig(estimator="rloo"))
    np.testing.assert_allclose(batch.pre_clamp.numpy(), [0.75, -0.75, 0.0], atol=1e-6)
    np.testing.assert_allclose(batch.advantages.numpy(), [0.75, 0.0, 0.0], atol=1e-6)


def test_all_excluded_batch() -> None:
    batch = compute_advantages([None, None], [0, 0], [-1, 1])
    assert batch.advantages.tolist() == [0.0, 0.0] and not batch.keep.any()


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 24))
def test_clamp_only_lifts_fatal_sequences(data, n) -> None:
    rewards = data.draw(st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=n, max_size=n))
    groups = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    fatal = data.draw(st.lists(st.integers(-1, 5), min_size=n, max_size=n))
    clamp = compute_advantages(rewards, groups, fatal, AdvantageConfig(mode="fatal_clamp"))
    mask = compute_advantages(rewards, groups, fatal, AdvantageConfig(mode="fatal_mask"))
    assert torch.equal(clamp.pre_clamp, mask.pre_clamp)
    is_fatal = torch.tensor([f != -1 for f in fatal])
    assert torch.equal(clamp.advantages[~is_fatal], mask.advantages[~is_fatal])
    assert torch.equal(clamp.advantages[is_fatal], mask.advantages[is_fatal].clamp_min(0))
    assert (clamp.advantages[[r is None for r in rewards]] == 0).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="clamp"), "unknown fatal mode 'clamp'"),
        (dict(mode="Fatal_Clamp"), "unknown fatal mode"),
        (dict(estimator="ppo"), "unknown estimator"),
        (dict(std="sample"), "unknown std"),
    ],
)
def test_bad_config(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        AdvantageConfig(**kwargs)


def test_bad_lengths() -> None:
    with pytest.raises(ValueError, match="same length"):
        compute_advantages([1.0, 0.0], [0], [-1, -1])
    with pytest.raises(ValueError, match="exclusions"):
        compute_advantages([1.0], [0], [-1], exclusions=[None, None])


def test_trajectories_end_to_end_with_offline_judges() -> None:
    batch = [
        trajectory(["ok"], answer="1982", group_id=0, sample_index=0),
        trajectory(["ok", "tool_error", "tool_error", "tool_error"], answer=None, group_id=0, sample_index=1),
        trajectory(["ok"], answer="1990", group_id=0, sample_index=2),
        trajectory(
            ["ok", "infra_error"],
            answer="1982",
            group_id=0,
            sample_index=3,
        ),
        trajectory(["ok"], answer="1982", group_id=1, sample_index=0),
    ]
    scored = score_batch(batch, ExactMatchAccuracyJudge(), HeuristicQueryJudge())
    scored[4].reward = RewardParts(fmt=1.0, acc=None, query=0.5, total=None, unscored_reason="accuracy:timeout")
    result = trajectory_advantages(scored)
    assert result.drop_reasons == (None, None, None, "infra_error", "unscored")
    assert result.loss_fatal_steps.tolist() == [-1, 3, -1, -1, -1]
    totals = [t.reward.total for t in scored[:3]]
    pre = grpo(totals)
    np.testing.assert_allclose(result.pre_clamp.numpy()[:3], pre, rtol=1e-5, atol=1e-6)
    assert result.advantages[1] == max(pre[1], 0.0)
    stats = batch_stats(result, scored)
    assert (stats.sequences, stats.scored, stats.unscored, stats.infra_dropped) == (5, 3, 1, 1)
    assert stats.unscored_reasons == {"accuracy:timeout": 1}
    with pytest.raises(ValueError, match="no reward record"):
        trajectory_advantages(batch)


def test_kept_outage_rollouts_enter_the_group_and_are_counted() -> None:
    from osvl.rl.fatal import FatalConfig
    from osvl.rl.rewards import RewardConfig

    batch = [
        trajectory(["ok"], answer="1982", group_id=0, sample_index=0),
        trajectory(["ok", "infra_error", "infra_error", "infra_error"], answer=None, group_id=0, sample_index=1),
        trajectory(["ok", "infra_error", "ok"], answer="1982", group_id=0, sample_index=2),
        trajectory(["ok"], answer="1990", group_id=0, sample_index=3),
    ]
    paper = RewardConfig(fatal=FatalConfig(errors="all"), infra_rollouts="keep")
    scored = score_batch(batch, ExactMatchAccuracyJudge(), HeuristicQueryJudge(), paper)
    result = trajectory_advantages(scored)
    assert result.drop_reasons == (None,) * 4 and bool(result.in_statistics.all())
    assert result.loss_fatal_steps.tolist() == [-1, 3, -1, -1]  # the outage's cascade is masked from the breach
    np.testing.assert_allclose(result.pre_clamp.numpy(), grpo([t.reward.total for t in scored]), rtol=1e-5)
    stats = batch_stats(result, scored)
    assert (stats.infra_kept, stats.infra_dropped, stats.fatal) == (2, 0, 1)
    dropped = batch_stats(
        trajectory_advantages(score_batch(batch, ExactMatchAccuracyJudge(), HeuristicQueryJudge())), scored
    )
    assert (dropped.infra_kept, dropped.infra_dropped, dropped.scored) == (0, 2, 2)


def test_figure5_bookkeeping() -> None:
    # group 0: fatal rollouts at 0.0 and 0.0 fall below the mean; group 1: a fatal one beats it
    rewards = [1.0, 0.0, 0.0, 0.8, 0.9, 0.0, 0.1, None]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    fatal = [-1, 2, 5, -1, 3, -1, -1, 1]
    batch = compute_advantages(rewards, groups, fatal)
    stats = batch_stats(batch)
    pre0, pre1 = grpo([1.0, 0.0, 0.0, 0.8]), grpo([0.9, 0.0, 0.1])
    assert (stats.sequences, stats.scored, stats.unscored, stats.fatal) == (8, 7, 1, 3)
    assert (stats.clamped, stats.preserved) == (2, 1)
    assert stats.fatal_fraction == pytest.approx(3 / 7)
    assert stats.clamped_fraction == pytest.approx(2 / 3)
    assert stats.mean_pre_clamp_zeroed == pytest.approx((pre0[1] + pre0[2]) / 2, rel=1e-5)
    assert stats.mean_pre_clamp_preserved == pytest.approx(pre1[0], rel=1e-5)
    nonfatal = [pre0[0], pre0[3], pre1[1], pre1[2]]
    assert stats.mean_pre_clamp_nonfatal == pytest.approx(sum(nonfatal) / 4, rel=1e-5, abs=1e-6)
    metrics = stats.as_metrics()
    assert metrics["rl/clamped_fraction"] == pytest.approx(2 / 3)
    assert all(isinstance(v, float) for v in metrics.values())
    # the non-clamping ablations report the same split (what the clamp would have done)
    assert batch_stats(compute_advantages(rewards, groups, fatal, AdvantageConfig(mode="vanilla"))).clamped == 2


def test_fatal_at_the_group_mean_is_preserved_not_zeroed() -> None:
    stats = batch_stats(compute_advantages([0.5, 0.5, 0.5], [0, 0, 0], [2, -1, 0]))
    assert (stats.fatal, stats.clamped, stats.preserved) == (2, 0, 2)
    assert stats.mean_pre_clamp_preserved == 0.0 and stats.mean_pre_clamp_zeroed is None


def test_stats_of_a_batch_without_fatal_rollouts() -> None:
    stats = batch_stats(compute_advantages([1.0, 0.0], [0, 0], [-1, -1]))
    assert stats.fatal == 0 and stats.fatal_fraction == 0.0
    assert stats.clamped_fraction is None and stats.mean_pre_clamp_zeroed is None
    assert "rl/clamped_fraction" not in stats.as_metrics()


def test_group_signal_counts_groups_that_carry_a_gradient() -> None:
    from osvl.rl.stats import group_signal

    def scored(group_id: int, totals_accs: list[tuple[float | None, float | None]]) -> list:
        out = []
        for i, (total, acc) in enumerate(totals_accs):
            t = trajectory(["ok"], group_id=group_id, sample_index=i)
            t.reward = RewardParts(fmt=1.0, acc=acc, query=0.5, total=total)
            out.append(t)
        return out

    batch = [
        *scored(0, [(0.9, 1.0), (0.1, 0.0), (0.1, 0.0)]),  # mixed answers: reward and accuracy signal
        *scored(1, [(0.2, 0.0), (0.1, 0.0), (0.2, 0.0)]),  # all wrong, queries differ: reward signal only
        *scored(2, [(0.1, 0.0), (0.1, 0.0), (0.1, 0.0)]),  # all equal: no gradient
        *scored(3, [(0.9, 1.0), (None, None)]),  # one scored: not a group
    ]
    signal = group_signal(batch)
    assert (signal.groups, signal.reward, signal.accuracy) == (3, pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert signal.as_metrics() == {
        "signal_groups": pytest.approx(2 / 3),
        "accuracy_signal_groups": pytest.approx(1 / 3),
    }
    empty = group_signal(scored(0, [(0.5, 1.0)]))
    assert (empty.groups, empty.reward, empty.as_metrics()) == (0, None, {})
