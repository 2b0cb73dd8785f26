"""MoE router losses of the tiny_moe preset on 2 gloo ranks (FSDP2 + EP 2 + full AC, FSDP2, TP 2): the
attached losses, the gradient they give every parameter and the logged statistics equal a float64
one-process reference."""

import json

import pytest

from osvl.model.presets import preset
from osvl.parallel import ParallelConfig, validate_parallel
from tests.parallel.harness import run_ranks
from tests.parallel.moe_workers import SCENARIOS, run_scenarios


def test_router_losses_match_float64_on_two_ranks(tmp_path):
    run_ranks(run_scenarios, 2, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results.keys() == SCENARIOS.keys()
    failed = {name: tb for name, tb in results.items() if tb != "ok"}
    assert not failed, "\n\n".join(f"[{name}]\n{tb}" for name, tb in failed.items())


def test_tensor_and_expert_parallel_together_is_refused():
    with pytest.raises(ValueError, match="sequence parallelism"):
        validate_parallel(ParallelConfig(dp_shard=16, tp=4, ep=8), preset("qwen3_vl_30b_a3b"), 64)
