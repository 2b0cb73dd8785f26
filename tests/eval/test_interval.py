"""Wilson score intervals against published values and their closed forms."""

from __future__ import annotations

import pytest

from osvl.eval.interval import wilson_interval


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
