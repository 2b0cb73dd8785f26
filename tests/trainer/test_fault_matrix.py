"""The fault matrix: GRPO on 2 trainer ranks over the CPU service topology, synchronous and with one step
of staleness; the tool server, the engine, the judge or one trainer rank killed with SIGKILL at a seeded
random moment of step 1, 2 or 3. Each run finishes every step, a restarted service used again, or stops
with one clear line within its deadline (a killed trainer rank); never a hang, records and checkpoints
whole, no process of the run left behind. docs/reliability.md shows the matrix over more seeds
(``python -m tests.trainer.faults OUT SEED``)."""

from __future__ import annotations

import os
import random

import pytest

from tests.trainer.faults import FAULTS, HANG_S, KILL_STEPS, MAX_DELAY_S, MODES, matrix_overrides, run_fault

pytestmark = pytest.mark.slow
SEED = int(os.environ.get("OSVL_FAULT_SEED", "0"))


def kill_point(mode: str, fault: str) -> tuple[int, float]:
    """The step and the seconds into it of one cell's kill, drawn from the matrix seed."""
    rng = random.Random(f"{SEED}:{mode}:{fault}")
    return rng.choice(KILL_STEPS), round(rng.uniform(0.0, MAX_DELAY_S), 2)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return matrix_overrides(tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_killed_process_heals_or_stops_loudly(mode, fault, shared, tmp_path):
    base, model_dir = shared
    step, delay = kill_point(mode, fault)
    outcome = run_fault(tmp_path, base, model_dir, fault, step, delay, mode)
    what = f"{fault} killed {delay} s into step {step} ({mode}): {outcome}"
    assert outcome.killed_pid, what
    assert outcome.result != "hang" and outcome.seconds < HANG_S, what
    assert outcome.records_clean and outcome.leftovers == [], what
    if fault == "rank":
        assert outcome.result == "stopped" and outcome.message, what
        assert outcome.steps_logged == list(range(1, len(outcome.steps_logged) + 1)), what
    else:
        assert outcome.result == "finished", what
        assert outcome.healed, what  # a step after the restart used the service again
