"""Options that need no second rank: selective AC and torch.compile of the decoder blocks (with the
MoE router losses attached too)
(aot_eager backend: the fullgraph capture is what is under test, not a C++ toolchain)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from osvl.model.router import Qwen3VLRouter, RouterLossInputs
from osvl.parallel import ParallelConfig, parallel_dims, parallelize, sharded_model_config
from tests.model.tiny import image_batch, tiny_config


def test_compiled_selective_ac_matches_eager():
    torch.manual_seed(0)
    arch = tiny_config(moe=True)  # MoE layers exercise the data-dependent expert split under fullgraph
    parallel = ParallelConfig(
        dp_shard=1, activation_checkpoint="selective", compile=True, compile_backend="aot_eager", param_dtype="float32"
    )
    model = sharded_model_config(arch, parallel).build()
    with torch.no_grad():
        model.init_states()
    eager = copy.deepcopy(model)
    ids, cu, pos, px, grid, _ = image_batch(arch, [(1, 2, 2), (1, 4, 2)])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        dims = parallel_dims(parallel, 1)
        dims.build_mesh()
        parallelize(model, dims, parallel)
        block = model.layers["0"]
        assert block._compiled_call_impl is not None  # torch.compile applied
        assert isinstance(block, CheckpointWrapper)  # AC applied
        outs = []
        for m in (eager, model):
            out = m(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid)
            out.logsumexp(-1).sum().backward()
            outs.append(out.detach())
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    compiled = {
        n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): p for n, p in model.named_parameters()
    }
    for name, p in eager.named_parameters():
        torch.testing.assert_close(compiled[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_blocks_attach_the_same_router_losses():
    """fullgraph capture of a block whose router attaches its losses and records its statistics."""
    torch.manual_seed(0)
    arch = tiny_config(moe=True)
    parallel = ParallelConfig(
        dp_shard=1, activation_checkpoint="full", compile=True, compile_backend="aot_eager", param_dtype="float32"
    )
    model = sharded_model_config(arch, parallel).build()
    with torch.no_grad():
        model.init_states()
    eager = copy.deepcopy(model)
    ids, cu, pos, px, grid, _ = image_batch(arch, [(1, 2, 2), (1, 4, 2)])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        dims = parallel_dims(parallel, 1)
        dims.build_mesh()
        parallelize(model, dims, parallel)
        balances = []
        for m in (eager, model):
            for router in (r for r in m.modules() if isinstance(r, Qwen3VLRouter)):
                router.loss_inputs = RouterLossInputs(
                    0.5, 0.1, routed_tokens=ids.shape[0] - 3, step_tokens=ids.shape[0]
                )
            out = m(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid)
            (out.sum() * 0).backward()  # only the attached router losses
            balances.append([float(r.stats.balance) for r in m.modules() if isinstance(r, Qwen3VLRouter)])
    finally:
        dist.destroy_process_group()
    assert balances[1] == pytest.approx(balances[0], rel=1e-6)
    compiled = {
        n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): p for n, p in model.named_parameters()
    }
    checked = 0
    for name, p in eager.named_parameters():
        if p.grad is not None and p.grad.any():
            torch.testing.assert_close(
                compiled[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
            checked += 1
    assert checked > 5
