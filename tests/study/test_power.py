"""The study's power analysis from its pilot (vanilla at outage 0 over seeds), on tables built by hand so the
expected answers are known: a gain shown or not, and a detectable difference that grows with the seeds'
disagreement and is zero when the seeds agree."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from osvl.study.power import PILOT, pilot_power, read_power, save_power
from osvl.study.report import orderings_table
from osvl.study.rows import StudyRows
from osvl.study.runs import StudyConfig

PROMPTS = [f"q{i:03d}" for i in range(96)]
CLUSTERS = [f"a{i // 3}" for i in range(96)]  # 32 anchors of 3 questions


def _rows(sft: np.ndarray, seeds: list[np.ndarray], settings: dict | None = None) -> StudyRows:
    as_rows = lambda values: {p: {"correct": float(v)} for p, v in zip(PROMPTS, values, strict=True)}  # noqa: E731
    by_setting = {PILOT: {seed: as_rows(values) for seed, values in enumerate(seeds)}}
    for key, runs in (settings or {}).items():
        by_setting[key] = {seed: as_rows(values) for seed, values in enumerate(runs)}
    return StudyRows(PROMPTS, CLUSTERS, by_setting, as_rows(sft), done=len(seeds), planned=24)


def _policy(rng: np.random.Generator, accuracy: float) -> np.ndarray:
    return (rng.random(len(PROMPTS)) < accuracy).astype(float)


def test_seeds_that_agree_leave_nothing_undetectable_and_a_clear_gain_is_shown():
    rng = np.random.default_rng(0)
    sft = _policy(rng, 0.3)
    vanilla = np.maximum(sft, _policy(rng, 0.4))  # every wrong answer has a 40% chance to turn right
    power = pilot_power(_rows(sft, [vanilla] * 3), StudyConfig())
    assert power.gains and power.gain.value == pytest.approx(vanilla.mean() - sft.mean())
    assert power.null_difference.value == 0.0 and power.detectable == 0.0
    assert power.seed_accuracies == [pytest.approx(vanilla.mean())] * 3 and power.clusters == 32


def test_the_detectable_difference_grows_with_the_seeds_disagreement():
    rng = np.random.default_rng(1)
    sft = _policy(rng, 0.3)
    detectable = []
    for flips in (0.05, 0.2):  # each seed's run changes this share of the answers at random
        seeds = [np.where(rng.random(len(PROMPTS)) < flips, 1 - sft, sft) for _ in range(3)]
        power = pilot_power(_rows(sft, seeds), StudyConfig())
        # (z_0.975 + z_0.8) standard errors, the error read off the null difference's 95% interval
        half_width = (power.null_difference.high - power.null_difference.low) / 2
        assert power.detectable == pytest.approx(2.8016 * half_width / 1.95996, rel=1e-3)
        detectable.append(power.detectable)
    assert 0.0 < detectable[0] < detectable[1]
    # more seeds in the full study than in the pilot: a finer resolution, by the square root
    six = pilot_power(_rows(sft, seeds), replace(StudyConfig(), seeds=(0, 1, 2, 3, 4, 5)))
    assert six.detectable == pytest.approx(detectable[1] / np.sqrt(2))


def test_no_gain_is_reported_as_such_and_a_missing_pilot_is_named():
    rng = np.random.default_rng(2)
    sft = _policy(rng, 0.5)
    power = pilot_power(_rows(sft, [sft, sft, sft]), StudyConfig())
    assert not power.gains and power.gain.value == 0.0
    with pytest.raises(ValueError, match="vanilla at outage 0 for >= 2 seeds"):
        pilot_power(_rows(sft, [sft]), StudyConfig())
    with pytest.raises(ValueError, match="no SFT evaluation"):
        pilot_power(replace(_rows(sft, [sft, sft]), sft=None), StudyConfig())


def test_power_is_kept_beside_the_runs_and_read_back(tmp_path):
    rng = np.random.default_rng(3)
    sft = _policy(rng, 0.3)
    seeds = [np.maximum(sft, _policy(rng, 0.3)) for _ in range(3)]
    study = StudyConfig(out=str(tmp_path))
    assert read_power(study) is None
    power = pilot_power(_rows(sft, seeds), study)
    save_power(power, study)
    assert read_power(study) == power


def test_orderings_are_shown_reversed_or_undetermined_at_the_pilots_resolution():
    rng = np.random.default_rng(4)
    sft = _policy(rng, 0.3)
    vanilla = [np.maximum(sft, _policy(rng, 0.2)) for _ in range(3)]
    better = [np.maximum(v, _policy(rng, 0.5)) for v in vanilla]  # far above vanilla on every seed
    worse = [np.minimum(v, _policy(rng, 0.3)) for v in vanilla]  # far below
    rows = _rows(
        sft,
        vanilla,
        {
            (0.0, "all/keep", "hard_mask"): vanilla,  # identical: no difference at all
            (0.0, "all/keep", "fatal_mask"): better,
            (0.0, "all/keep", "fatal_clamp"): worse,
        },
    )
    power = pilot_power(rows, StudyConfig())
    lines = orderings_table(rows, [0.0], power).splitlines()
    verdicts = {line.split(" | ")[1]: line.split(" | ")[3] for line in lines[2:]}
    assert verdicts == {
        "vanilla <= hard_mask": "not reversed (the interval holds zero)",
        "hard_mask < fatal_mask": "shown",
        "fatal_mask < fatal_clamp": "**reversed**",
        "vanilla < fatal_clamp": "**reversed**",
    }
    assert all(line.endswith(f"| {power.detectable:.3f} |") for line in lines[2:])
    assert "| – |" in orderings_table(rows, [0.0], None)  # before the pilot was assessed: no resolution to state
