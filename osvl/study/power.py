"""The study's resolution, fixed from its pilot before any mode is compared (``python -m osvl.study power``).

The pilot is vanilla GRPO at outage 0 over the study's seeds, the runs the full study would make first. It
answers two questions. Does vanilla gain over SFT at this many steps, with an interval clear of zero? If not,
no mode can be told from another and the study stops there. And how large must a difference between two
modes be for the study to see it? Two vanilla runs of different seeds differ only by the run's randomness,
which is exactly a null difference between two modes: pairing each pilot seed with the next (0 with 1, 1
with 2, 2 with 0) and putting that difference through the report's own bootstrap (over seeds and anchor
entities) gives the standard error of a mode-vs-vanilla difference, and the smallest difference detectable
at 80% power, two-sided 5%, is (z_0.975 + z_0.8) times it. Settings share their seeds' random streams
(common random numbers), so two modes' runs are closer than two seeds' and this resolution is conservative.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from osvl.eval.interval import Estimate, bootstrap_interval
from osvl.study.rows import ACCURACY, MAIN_CHOICE, StudyRows
from osvl.study.runs import StudyConfig

PILOT = (0.0, MAIN_CHOICE, "vanilla")  # the setting the pilot runs: vanilla GRPO at outage 0, the paper's counting
POWER_FILE = "power.json"
CONFIDENCE, POWER = 0.95, 0.80


@dataclass(frozen=True)
class Power:
    """What the pilot says of the study's resolution (accuracies on the held-out prompts, greedy)."""

    steps: int
    seeds: list[int]
    prompts: int
    clusters: int
    sft_accuracy: float
    seed_accuracies: list[float]  # vanilla's, seed by seed
    gain: Estimate  # vanilla - SFT, paired by prompt, over seeds and clusters
    null_difference: Estimate  # seed k+1 - seed k of vanilla: a difference made by the runs' randomness alone
    standard_error: float  # of a difference between two settings over the study's seeds
    detectable: float  # the smallest difference found at 80% power, two-sided 5%

    @property
    def gains(self) -> bool:
        return self.gain.low > 0.0


def _z(probability: float) -> float:
    return NormalDist().inv_cdf(probability)


def pilot_power(rows: StudyRows, study: StudyConfig) -> Power:
    """The pilot's gain and the study's detectable difference, from the finished pilot runs in ``rows``."""
    seeds = sorted(rows.settings.get(PILOT, {}))
    if len(seeds) < 2 or rows.sft is None:
        raise ValueError(
            f"the pilot needs vanilla at outage 0 for >= 2 seeds and the SFT evaluation, found seeds {seeds} and "
            f"{'an' if rows.sft else 'no'} SFT evaluation: run `python -m osvl.study run --modes vanilla --rates 0`"
        )
    vanilla, sft = rows.table(PILOT, ACCURACY), rows.table(None, ACCURACY)
    numerator = vanilla[0]
    shifted = (np.roll(numerator, -1, axis=0), None)  # seed k paired with seed k+1: two draws of the same setting
    null = bootstrap_interval(shifted, (numerator, None), clusters=rows.clusters, confidence=CONFIDENCE)
    # the interval's half width over z is the standard error at the pilot's seed count; the study's scales with it
    error = (null.high - null.low) / (2 * _z(0.5 + CONFIDENCE / 2)) * math.sqrt(len(seeds) / len(study.seeds))
    return Power(
        steps=study.steps,
        seeds=seeds,
        prompts=len(rows.prompts),
        clusters=len(set(rows.clusters)),
        sft_accuracy=float(sft[0].mean()),
        seed_accuracies=[float(a) for a in numerator.mean(axis=1)],
        gain=bootstrap_interval(vanilla, sft, clusters=rows.clusters, confidence=CONFIDENCE),
        null_difference=null,
        standard_error=error,
        detectable=(_z(0.5 + CONFIDENCE / 2) + _z(POWER)) * error,
    )


def power_markdown(power: Power, study: StudyConfig) -> str:
    seeds = ", ".join(f"{a:.3f}" for a in power.seed_accuracies)
    verdict = (
        "clears zero: the steps hold, the study runs"
        if power.gains
        else "**does not clear zero: no mode can be told from vanilla at these steps; raise `--steps` and rerun "
        "the pilot**"
    )
    return "\n".join(
        [
            f"Pilot: vanilla GRPO at outage 0 (`all` / `keep`), {power.steps} steps, seeds {power.seeds}, greedy on "
            f"{power.prompts} held-out prompts ({power.clusters} anchor entities).",
            "",
            "| | value |",
            "|---|---:|",
            f"| SFT accuracy | {power.sft_accuracy:.3f} |",
            f"| vanilla accuracy, seed by seed | {seeds} (sd {statistics.stdev(power.seed_accuracies):.3f}) |",
            f"| vanilla - SFT, over seeds and anchors | {power.gain.value:+.3f} "
            f"[{power.gain.low:+.3f}, {power.gain.high:+.3f}] |",
            f"| seed k+1 - seed k of vanilla (a null difference) | {power.null_difference.value:+.3f} "
            f"[{power.null_difference.low:+.3f}, {power.null_difference.high:+.3f}] |",
            f"| standard error of a mode - vanilla difference, {len(study.seeds)} seeds | {power.standard_error:.3f} |",
            f"| **smallest difference detectable at 80% power (two-sided 5%)** | **{power.detectable:.3f}** |",
            "",
            f"Vanilla's gain over SFT {verdict}. Differences between modes smaller than {power.detectable:.3f} in "
            "accuracy are below this study's resolution: an interval that holds zero there is no evidence of no "
            "effect.",
        ]
    )


def save_power(power: Power, study: StudyConfig) -> Path:
    """Kept beside the runs, so the report judges the orderings at the resolution fixed before them."""
    path = Path(study.out) / POWER_FILE
    path.write_text(json.dumps(asdict(power), indent=2) + "\n")
    return path


def read_power(study: StudyConfig) -> Power | None:
    """The pilot's power as :func:`save_power` kept it, or None before the pilot was assessed."""
    path = Path(study.out) / POWER_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    for key in ("gain", "null_difference"):
        record[key] = Estimate(**record[key])
    return Power(**record)
