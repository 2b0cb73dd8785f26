"""2 gloo ranks vs one process: FSDP2 (+full AC, +CPU offload), TP=2, EP=2 give the same loss
and gradients; DCP save -> load round-trips exactly. All scenarios share one spawn (process
start dominates the cost on CPU), so this is one test that names every failing scenario."""

import json

from tests.parallel.harness import run_ranks
from tests.parallel.workers import SCENARIOS, run_scenarios


def test_two_rank_scenarios_match_one_process(tmp_path):
    run_ranks(run_scenarios, 2, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results.keys() == SCENARIOS.keys()
    failed = {name: tb for name, tb in results.items() if tb != "ok"}
    assert not failed, "\n\n".join(f"[{name}]\n{tb}" for name, tb in failed.items())
