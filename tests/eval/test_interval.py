"""Wilson score intervals against published values and their closed forms."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from osvl.eval.interval import (
    SharpeningRoom,
    bootstrap_interval,
    clustered_paired_difference,
    paired_difference,
    pass_at_k,
    sharpening_room,
    wilson_interval,
)


@pytest.mark.parametrize(
    "successes, trials, low, high",
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (Wilson score).
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_matches_newcombe_table(successes, trials, low, high):
    got = wilson_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_edges_symmetry_and_width():
    z2 = 1.959963984540054**2
    assert wilson_interval(0, 64) == pytest.approx((0.0, z2 / (64 + z2)))
    assert wilson_interval(64, 64) == pytest.approx((64 / (64 + z2), 1.0))
    low, high = wilson_interval(5, 64)
    assert (1 - high, 1 - low) == pytest.approx(wilson_interval(59, 64))
    assert low < 5 / 64 < high
    assert wilson_interval(50, 640)[1] - wilson_interval(50, 640)[0] < high - low  # more prompts, narrower
    assert wilson_interval(5, 64, confidence=0.99)[1] > high
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("args", [(5, 4), (-1, 4), (1, -2), (1, 4, 1.0), (1, 4, 0.0)])
def test_bad_inputs_raise_value_error(args):
    with pytest.raises(ValueError):
        wilson_interval(*args)


def test_bootstrap_of_a_mean_covers_it_and_narrows_with_more_prompts():
    rng = np.random.default_rng(1)
    small = (rng.random((3, 32)) < 0.3).astype(float)
    large = (rng.random((3, 512)) < 0.3).astype(float)
    a, b = bootstrap_interval((small, None)), bootstrap_interval((large, None))
    assert a.value == pytest.approx(small.mean()) and a.low < a.value < a.high
    assert b.high - b.low < (a.high - a.low) / 2  # ~1/sqrt(16) of the width
    assert bootstrap_interval((small, None)) == a  # seeded: the same report twice


def test_bootstrap_of_a_proportion_matches_wilson_for_one_seed():
    table = np.zeros((1, 200))
    table[0, :60] = 1.0
    boot = bootstrap_interval((table, None), resamples=8000)
    low, high = wilson_interval(60, 200)
    assert abs(boot.low - low) < 0.015 and abs(boot.high - high) < 0.015


def test_seed_variation_widens_the_interval():
    prompts = np.tile((np.arange(64) % 4 == 0).astype(float), (3, 1))  # every seed the same: only prompt noise
    shifted = prompts.copy()
    shifted[0] = 1.0  # one seed much better: seed noise on top
    calm, noisy = bootstrap_interval((prompts, None)), bootstrap_interval((shifted, None))
    assert noisy.high - noisy.low > 2 * (calm.high - calm.low)


def test_ratio_of_sums_and_an_undefined_ratio():
    calls = np.array([[2.0, 4.0, 0.0], [1.0, 3.0, 0.0]])
    answered = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert bootstrap_interval((calls, answered)).value == pytest.approx(10 / 4)
    nothing = bootstrap_interval((calls, np.zeros_like(calls)))
    assert math.isnan(nothing.value) and math.isnan(nothing.low)


def test_paired_difference_sees_a_shift_the_marginal_intervals_hide():
    rng = np.random.default_rng(3)
    hard = rng.random(64)  # prompts differ a lot in difficulty; the two settings share them
    base = np.tile((hard < 0.5).astype(float), (3, 1))
    better = np.tile((hard < 0.6).astype(float), (3, 1))
    diff = bootstrap_interval((better, None), (base, None))
    assert diff.value == pytest.approx(better.mean() - base.mean()) and diff.excludes_zero()
    a, b = bootstrap_interval((better, None)), bootstrap_interval((base, None))
    assert a.low < b.high  # the marginal intervals overlap
    same = bootstrap_interval((base, None), (base, None))
    assert same.value == 0.0 and not same.excludes_zero()


@pytest.mark.parametrize(
    ("table", "baseline", "message"),
    [
        (np.zeros(5), None, r"\[seeds, prompts\]"),
        (np.zeros((2, 0)), None, r"\[seeds, prompts\]"),
        (np.full((2, 3), np.nan), None, "finite"),
        (np.zeros((2, 3)), (np.zeros((2, 4)), None), "same prompts"),
    ],
)
def test_bootstrap_refuses_bad_tables(table, baseline, message):
    with pytest.raises(ValueError, match=message):
        bootstrap_interval((table, None), baseline)
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval((np.zeros((1, 2)), None), confidence=1.0)


def test_matched_seeds_are_paired_in_a_difference():
    rng = np.random.default_rng(5)
    seed_effect = np.array([[0.0], [0.5], [1.0]])  # seeds differ a lot; each seed moves both settings alike
    base = np.clip(seed_effect + 0.1 * rng.random((3, 64)), 0, None)
    shifted = base + 0.05
    paired = bootstrap_interval((shifted, None), (base, None))
    assert paired.value == pytest.approx(0.05) and paired.high - paired.low < 1e-9  # the seed noise cancels
    unpaired = bootstrap_interval((shifted, None), (base[:2], None))  # 3 seeds vs 2: drawn independently
    assert unpaired.high - unpaired.low > 0.1


def test_pass_at_k_matches_the_combinatorial_formula_and_brute_force():
    # 2 right of 4: pass@1 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 5/6, pass@3 = pass@4 = 1
    assert pass_at_k([[1, 0, 1, 0]], 1) == pytest.approx(0.5)
    assert pass_at_k([[1, 0, 1, 0]], 2) == pytest.approx(5 / 6)
    assert pass_at_k([[1, 0, 1, 0]], 3) == pytest.approx(1.0)
    # brute force over every k-subset of 5 samples with 1 right
    samples = [0, 0, 1, 0, 0]
    subsets = list(itertools.combinations(samples, 2))
    assert pass_at_k([samples], 2) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    # averaged over prompts; all wrong gives 0, all right 1
    assert pass_at_k([[0, 0, 0, 0], [1, 1, 1, 1]], 4) == pytest.approx(0.5)


def test_pass_at_k_leaves_out_unscored_samples_and_short_prompts():
    assert pass_at_k([[1, None, 0, None]], 2) == pytest.approx(1.0)  # 1 right of 2 scored
    assert pass_at_k([[1, None, None, None], [0, 0, 0, 0]], 2) == pytest.approx(0.0)  # the first has 1 < k
    assert math.isnan(pass_at_k([[None, None]], 1))
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k([[1]], 0)


def test_sharpening_room_counts_greedy_misses_a_sample_answers_and_shaky_greedy_answers():
    greedy = {"a": 0.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 1.0, "f": 0.0}
    sampled = {
        "a": [0, 1, 0, 0],  # a miss one sample answers: sharpening could turn it
        "b": [0, 0, 0, 0],  # a miss no sample answers: out of reach
        "c": [1, 0, 0, 0],  # a greedy answer one sample in four gives: at risk
        "d": [1, 1, 0, 0],  # half is not fewer than half
        "e": [1, 1, 1, 1],
        "f": [None, 1, None, 0],  # unscored samples are left out; one right of two
    }
    assert sharpening_room(greedy, sampled) == SharpeningRoom(6, 3, 2, 3, 1)


def test_sharpening_room_leaves_out_unscored_prompts_and_refuses_mismatched_sets():
    room = sharpening_room({"a": None, "b": 0.0, "c": 1.0}, {"a": [1, 1], "b": [None, None], "c": [0, 0]})
    assert room == SharpeningRoom(
        prompts=1, greedy_wrong=0, wrong_sampled_right=0, greedy_right=1, right_sampled_minority=1
    )
    with pytest.raises(ValueError, match="same prompts; 1 differ"):
        sharpening_room({"a": 1.0}, {"a": [1], "b": [0]})
    with pytest.raises(ValueError, match="no prompt is scored"):
        sharpening_room({"a": None}, {"a": [1]})


def test_paired_difference_pairs_by_prompt_id_and_sees_a_consistent_gain():
    rng = np.random.default_rng(3)
    before = {f"q{i}": float(rng.random() < 0.3) for i in range(128)}
    # after: 16 wrong answers turn right, nothing else changes; keys in another order
    flipped = [p for p, acc in before.items() if acc == 0.0][:16]
    after = {p: 1.0 if p in flipped else before[p] for p in reversed(list(before))}
    estimate = paired_difference(after, before)
    assert estimate.value == pytest.approx(16 / 128)
    assert estimate.excludes_zero() and estimate.low > 0.05
    # the same marginals, unpaired noise: 16 up and 16 down cancel, the interval holds zero
    down = [p for p, acc in before.items() if acc == 1.0][:16]
    mixed = {p: 0.0 if p in down else after[p] for p in after}
    assert not paired_difference(mixed, before).excludes_zero()


def test_paired_difference_refuses_other_prompts_and_skips_unscored():
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference({"a": 1.0}, {"b": 1.0})
    with pytest.raises(ValueError, match="no prompt is scored"):
        paired_difference({"a": None}, {"a": 1.0})
    estimate = paired_difference({"a": 1.0, "b": None, "c": 1.0}, {"a": 0.0, "b": 1.0, "c": 1.0})
    assert estimate.value == pytest.approx(0.5)  # b left out of both


def _clustered_gain(clusters: int, per_cluster: int, gaining: int, seed: int = 0):
    """``clusters`` anchors of ``per_cluster`` questions each; every question of the first ``gaining``
    anchors turns from wrong to right, nothing else changes: a gain carried by whole anchors."""
    rng = np.random.default_rng(seed)
    anchors = {f"a{c}q{i}": f"a{c}" for c in range(clusters) for i in range(per_cluster)}
    before = {p: float(rng.random() < 0.3) for p in anchors}
    after = {p: 1.0 if int(anchors[p][1:].split("q")[0]) < gaining else v for p, v in before.items()}
    return after, before, anchors


def test_clustered_difference_is_the_paired_mean_and_wider_when_the_gain_comes_by_anchor():
    after, before, anchors = _clustered_gain(clusters=16, per_cluster=8, gaining=3)
    by_prompt = paired_difference(after, before)
    by_anchor = clustered_paired_difference(after, before, anchors)
    assert by_anchor.value == pytest.approx(by_prompt.value)
    # 128 questions but 16 independent draws: the anchor interval is the honest, wider one
    assert by_anchor.high - by_anchor.low > 1.5 * (by_prompt.high - by_prompt.low)
    assert by_prompt.excludes_zero() and by_anchor.low < by_prompt.low


def test_clustered_difference_with_one_question_per_anchor_matches_the_prompt_bootstrap():
    rng = np.random.default_rng(5)
    before = {f"q{i}": float(rng.random() < 0.4) for i in range(200)}
    after = {p: 1.0 if v == 0.0 and rng.random() < 0.3 else v for p, v in before.items()}
    by_prompt = paired_difference(after, before)
    by_anchor = clustered_paired_difference(after, before, {p: p for p in before})
    assert by_anchor.value == pytest.approx(by_prompt.value)
    assert by_anchor.low == pytest.approx(by_prompt.low, abs=0.02)
    assert by_anchor.high == pytest.approx(by_prompt.high, abs=0.02)


def test_clustered_difference_pools_runs_each_paired_with_its_own_baseline():
    first = _clustered_gain(clusters=20, per_cluster=4, gaining=6, seed=1)
    second = _clustered_gain(clusters=20, per_cluster=4, gaining=2, seed=2)
    pooled = clustered_paired_difference([first[0], second[0]], [first[1], second[1]], first[2])
    each = [clustered_paired_difference(a, b, c).value for a, b, c in (first, second)]
    assert pooled.value == pytest.approx(sum(each) / 2)
    assert pooled.low < pooled.value < pooled.high


def test_clustered_difference_refuses_what_it_cannot_resample():
    after, before, anchors = _clustered_gain(clusters=4, per_cluster=2, gaining=1)
    with pytest.raises(ValueError, match="no cluster"):
        clustered_paired_difference(after, before, {p: c for p, c in anchors.items() if p != "a0q0"})
    with pytest.raises(ValueError, match="at least 2 clusters"):
        clustered_paired_difference(after, before, dict.fromkeys(anchors, "one"))
    with pytest.raises(ValueError, match="pair each run"):
        clustered_paired_difference([after, after], [before], anchors)
    with pytest.raises(ValueError, match="same prompts"):
        clustered_paired_difference(after, {**before, "extra": 1.0}, anchors)
    unscored = {p: None for p in after}
    with pytest.raises(ValueError, match="no prompt is scored"):
        clustered_paired_difference(unscored, before, anchors)


def test_bootstrap_by_cluster_keeps_the_mean_and_widens_when_anchors_carry_the_outcome():
    after, before, anchors = _clustered_gain(clusters=16, per_cluster=8, gaining=3)
    prompts = sorted(after)
    table = lambda values: (np.array([[values[p] for p in prompts]]), None)  # noqa: E731
    clusters = [anchors[p] for p in prompts]
    by_prompt = bootstrap_interval(table(after), table(before))
    by_anchor = bootstrap_interval(table(after), table(before), clusters=clusters)
    assert by_anchor.value == pytest.approx(by_prompt.value)
    assert by_anchor.high - by_anchor.low > 1.5 * (by_prompt.high - by_prompt.low)
    # the same draws as the paired cluster bootstrap of single runs
    reference = clustered_paired_difference(after, before, anchors)
    assert by_anchor.low == pytest.approx(reference.low, abs=0.02)
    assert by_anchor.high == pytest.approx(reference.high, abs=0.02)


def test_bootstrap_by_cluster_keeps_ratios_of_sums_and_singleton_clusters_match_prompts():
    rng = np.random.default_rng(3)
    numerator = rng.integers(0, 5, size=(3, 60)).astype(float)
    denominator = rng.integers(1, 3, size=(3, 60)).astype(float)
    clusters = [f"c{i % 12}" for i in range(60)]
    clustered = bootstrap_interval((numerator, denominator), clusters=clusters)
    assert clustered.value == pytest.approx(numerator.sum() / denominator.sum())
    singletons = bootstrap_interval((numerator, None), clusters=[str(i) for i in range(60)])
    plain = bootstrap_interval((numerator, None))
    assert singletons.value == pytest.approx(plain.value)
    assert singletons.low == pytest.approx(plain.low, abs=0.05)
    assert singletons.high == pytest.approx(plain.high, abs=0.05)


def test_bootstrap_by_cluster_refuses_a_wrong_cluster_list():
    table = (np.ones((2, 4)), None)
    with pytest.raises(ValueError, match="3 clusters for 4 prompts"):
        bootstrap_interval(table, clusters=["a", "b", "c"])
    with pytest.raises(ValueError, match="at least 2 clusters"):
        bootstrap_interval(table, clusters=["a"] * 4)
