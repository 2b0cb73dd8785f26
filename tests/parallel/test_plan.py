import dataclasses

import pytest

from osvl.model.presets import PRESETS
from osvl.parallel import ParallelConfig
from osvl.parallel.plan import activation_bytes, main, plan
from tests.model.tiny import tiny_config


def test_fsdp_only_plan_shards_evenly_and_gathers_embeddings():
    report = plan("qwen3_vl_8b", world_size=64, parallel=ParallelConfig(dp_shard=64), tokens_per_rank=8192)
    assert report.total_params == 8_767_123_696
    assert abs(report.rank0_params * 64 / report.total_params - 1) < 0.01
    assert report.param_bytes == report.grad_bytes == 4 * report.rank0_params
    assert report.optimizer_bytes == 8 * report.rank0_params
    vocab, dim = 151936, 4096
    assert report.largest_gather_name in ("tok_embeddings", "norm")  # embeddings / (norm + lm_head) unit
    assert report.largest_gather_bytes >= vocab * dim * 2
    assert report.largest_gather_bytes < vocab * dim * 2 * 1.01


def test_ep_and_tp_plans_on_tiny_config(capsys):
    arch = tiny_config(moe=True)
    ep = plan(arch, world_size=4, parallel=ParallelConfig(dp_shard=4, ep=2), tokens_per_rank=64)
    tp = plan(arch, world_size=4, parallel=ParallelConfig(dp_shard=2, tp=2), tokens_per_rank=64)
    assert ep.total_params == tp.total_params
    assert ep.rank0_params < ep.total_params / 2
    assert tp.rank0_params < tp.total_params / 2
    report = main(["--model", "qwen3_vl_30b_a3b", "--world-size", "16", "--fsdp", "16", "--ep", "8", "--tokens", "4096"])
    out = capsys.readouterr().out
    assert "largest all-gather" in out and "qwen3_vl_30b_a3b" in out
    assert report.total_params == 31_070_754_032


def test_activation_estimate_scales_with_tokens_and_ac():
    arch = PRESETS["qwen3_vl_32b"]
    none = activation_bytes(arch, 1000, tp=1, ac="none")
    assert activation_bytes(arch, 2000, tp=1, ac="none") == 2 * none
    assert activation_bytes(arch, 1000, tp=1, ac="full") < none / 10
    assert activation_bytes(arch, 1000, tp=2, ac="none") < none


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=64, parallel=ParallelConfig(dp_shard=32)), "world_size"),
        (dict(world_size=64, parallel=ParallelConfig(dp_shard=64, ep=3)), "ep=3"),
        (dict(world_size=64, parallel=ParallelConfig(dp_shard=32, tp=2), tokens_per_rank=0), "positive"),
    ],
)
def test_bad_plans_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan("qwen3_vl_30b_a3b", **kwargs)


def test_cli_reports_errors_without_traceback(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "qwen3_vl_8b", "--world-size", "64", "--tp", "3"])
    assert "tp=3 must divide" in capsys.readouterr().err


def test_tp_plan_gathers_only_the_fsdp_shards():
    """Under FSDP x TP the embedding is _StridedShard over fsdp: the gather restores 1/tp of it."""
    arch = tiny_config()
    arch = dataclasses.replace(arch, text=dataclasses.replace(arch.text, vocab_size=4096))
    report = plan(arch, world_size=4, parallel=ParallelConfig(dp_shard=2, tp=2), tokens_per_rank=8)
    assert report.largest_gather_name == "tok_embeddings"
    assert report.largest_gather_bytes == 4096 * 32 // 2 * 2  # bf16, half the vocab per TP rank
