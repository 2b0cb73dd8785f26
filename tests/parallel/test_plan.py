import dataclasses

import pytest
import torch

from osvl.model import build_model
from osvl.model.attention import packed_metadata
from osvl.model.model import text_position_ids
from osvl.model.presets import PRESETS
from osvl.model.rope import mrope_table
from osvl.parallel import ParallelConfig
from osvl.parallel.plan import (
    activation_bytes,
    layer_activation_elements,
    loss_bytes,
    main,
    plan,
    vision_activation_bytes,
)
from tests.model.tiny import image_batch, tiny_config


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
    report = main(
        ["--model", "qwen3_vl_30b_a3b", "--world-size", "16", "--fsdp", "16", "--ep", "8", "--tokens", "4096"]
    )
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


def _medium(moe: bool):
    """Widths where per-token constants (norm statistics, routing indices) no longer dominate."""
    base = tiny_config(moe=moe)
    text = dataclasses.replace(
        base.text,
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        mrope_section=(16, 8, 8),
        num_experts=8 if moe else 0,
        num_experts_per_tok=2 if moe else 0,
        moe_intermediate_size=128 if moe else 0,
    )
    vision = dataclasses.replace(base.vision, hidden_size=128, intermediate_size=512, num_heads=2, out_hidden_size=256)
    return dataclasses.replace(base, text=text, vision=vision)


def _saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages a forward saves for its backward, parameters and tables excluded."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("moe", [False, True])
def test_layer_activation_estimate_matches_what_a_forward_saves(moe):
    """16-token documents keep CPU attention's own buffers negligible whichever SDPA kernel runs."""
    arch = _medium(moe)
    torch.manual_seed(0)
    model = build_model(arch)
    tokens = 1024
    cu = torch.arange(0, tokens + 1, 16, dtype=torch.int32)
    rope = mrope_table(text_position_ids(cu, tokens), head_dim=64, theta=1e4, sections=(16, 8, 8))
    h = torch.randn(1, tokens, 256, requires_grad=True)
    measured = _saved_bytes(
        lambda: model.layers["0"](h, packed_metadata(cu, tokens), rope), [*model.parameters(), rope]
    )
    estimate = layer_activation_elements(arch, tp=1) * tokens * 4
    assert 0.8 < measured / estimate < 1.25
    assert activation_bytes(arch, tokens, tp=1, ac="none", dtype_bytes=4) == 2 * estimate  # two layers


def test_vision_activation_estimate_matches_what_a_forward_saves():
    arch = _medium(False)
    model = build_model(arch)
    _, _, _, pixels, grid, _ = image_batch(arch, [(1, 4, 4)] * 32)
    pixels.requires_grad_(True)
    measured = _saved_bytes(lambda: model.visual(pixels, grid), list(model.parameters()))
    assert 0.8 < measured / vision_activation_bytes(arch, pixels.shape[0], 4) < 1.25


def test_loss_buffers_follow_the_stage_and_tensor_parallelism():
    arch = PRESETS["qwen3_vl_8b"]
    sft = loss_bytes(arch, 70000, chunk=4096, tp=1, stage="sft")
    grpo = loss_bytes(arch, 70000, chunk=4096, tp=1, stage="grpo")
    assert grpo < sft  # one bf16 logits chunk and a bf16 lm_head gradient instead of two fp32 chunks, fp32 grad
    assert loss_bytes(arch, 70000, chunk=4096, tp=4, stage="grpo") < grpo
    with pytest.raises(ValueError, match="stage"):
        loss_bytes(arch, 10, chunk=4, tp=1, stage="dpo")


def test_fit_verdict_and_the_largest_micro_batch_that_fits():
    parallel = ParallelConfig(dp_shard=16, tp=4, activation_checkpoint="full")
    roomy = plan("qwen3_vl_8b", world_size=64, parallel=parallel, tokens_per_rank=32768, gpu_memory_gib=95.5)
    assert roomy.fits and roomy.max_tokens_fit > 32768
    at_limit = plan(
        "qwen3_vl_8b", world_size=64, parallel=parallel, tokens_per_rank=roomy.max_tokens_fit, gpu_memory_gib=95.5
    )
    assert at_limit.fits and at_limit.gpu_bytes > 0.99 * at_limit.usable_bytes  # the bound is tight
    over = plan(
        "qwen3_vl_8b",
        world_size=64,
        parallel=parallel,
        tokens_per_rank=roomy.max_tokens_fit + 4096,
        gpu_memory_gib=95.5,
    )
    assert over.fits is False and over.max_tokens_fit == roomy.max_tokens_fit
    assert any("cpu_offload=true" in line for line in over.lines())
    assert over.max_tokens_fit_offload > over.max_tokens_fit
    offloaded = plan(
        "qwen3_vl_8b",
        world_size=64,
        parallel=dataclasses.replace(parallel, cpu_offload=True),
        tokens_per_rank=32768,
        gpu_memory_gib=95.5,
    )
    assert offloaded.gpu_bytes == roomy.gpu_bytes - roomy.steady_state_bytes
    assert plan("qwen3_vl_8b", world_size=64, parallel=parallel, tokens_per_rank=1024).fits is None  # no budget given
