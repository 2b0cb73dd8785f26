"""Rank bodies for the MoE router-loss test: each rank trains the tiny_moe preset on its own packed
micro-batch (with a filler document at its end) under one parallel plan, and compares the router
losses, their gradient and the logged statistics with a float64 one-process reference."""

from __future__ import annotations

import copy
import json
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from osvl.config.recipe import MoEConfig
from osvl.data.tokenizer import SpecialTokens
from osvl.model.moe_losses import load_cv
from osvl.model.router import Qwen3VLRouter
from osvl.parallel import ParallelConfig, parallel_dims, parallelize, sharded_model_config
from osvl.trainer.policy import tiny_arch
from osvl.trainer.router_losses import RouterLosses
from tests.model.moe_reference import layer_terms, top_k_margin
from tests.model.tiny import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB, image_batch
from tests.parallel.workers import GRIDS, _rank_batch

AUX, Z = 0.5, 0.1
FILLER = 3  # tokens of the filler document each rank's micro-batch ends with


def tiny_moe():
    """The tiny_moe CPU preset (osvl.trainer.policy) with the test batches' vocabulary and vision ids."""
    special = SpecialTokens(
        endoftext=0,
        im_start=1,
        im_end=2,
        vision_start=VISION_START,
        vision_end=VISION_END,
        image_pad=IMAGE_TOKEN,
        video_pad=VIDEO_TOKEN,
        tool_call_start=7,
        tool_call_end=8,
        tool_response_start=9,
        tool_response_end=10,
        think_start=11,
        think_end=12,
    )
    return tiny_arch(VOCAB, special, "tiny_moe")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _with_filler(batch):
    """Appends a 3-token text document, as the packer's filler documents follow the real ones."""
    ids, cu, pos, px, grid, lengths = batch
    ids = torch.cat([ids, torch.tensor([7, 8, 9])])
    cu = torch.cat([cu, cu[-1:] + FILLER])
    pos = torch.cat([pos, torch.arange(FILLER).expand(3, -1)], dim=1)
    return ids, cu, pos, px, grid, lengths


def _micro_batches(arch, dp_size):
    full = image_batch(arch, GRIDS)
    labels = torch.zeros(full[0].shape[0], dtype=torch.long)
    return [
        _with_filler(_rank_batch(full, labels, [d for d in range(len(GRIDS)) if d % dp_size == r])[0])
        for r in range(dp_size)
    ]


def _forward(model, batch):
    ids, cu, pos, px, grid, _ = batch
    return model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid)


def _reference(model, batches, top_k):
    """float64: every rank's micro-batch through the one-process model, router inputs captured."""
    routers = [m for m in model.modules() if isinstance(m, Qwen3VLRouter)]
    captured: list[torch.Tensor] = []
    hooks = [r.register_forward_pre_hook(lambda _m, args: captured.append(args[0][0])) for r in routers]
    routed = [int(b[1][-2]) for b in batches]
    total = sum(routed)
    loss, balance_sum, z_sum = 0.0, 0.0, 0.0
    counts = torch.zeros(len(routers), routers[0].num_experts, dtype=torch.float64)
    for batch, n in zip(batches, routed):
        captured.clear()
        _forward(model, batch)
        for layer, (x, router) in enumerate(zip(captured, routers)):
            assert top_k_margin(x[:n], router.gate.weight, top_k) > 1e-4  # fp32 chooses the experts fp64 does
            balance, z = layer_terms(x, router.gate.weight, top_k, n)
            loss = loss + AUX * n / total * balance + Z * n / total * z
            balance_sum += float(balance) * n / len(routers)
            z_sum += float(z) * n / len(routers)
            probs = torch.softmax(x[:n].detach() @ router.gate.weight.detach().t(), -1)
            counts[layer] += torch.bincount(probs.topk(top_k, -1).indices.flatten(), minlength=counts.shape[1])
    for hook in hooks:
        hook.remove()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    cv = load_cv(counts)
    stats = {
        "moe_aux_loss": balance_sum / total,
        "moe_z_loss": z_sum / total,
        "moe_load_cv": float(cv.mean()),
        "moe_load_cv_max": float(cv.max()),
    }
    return float(loss), grads, stats


def router_losses_match_float64(rank: int, world: int, parallel_kwargs: dict) -> None:
    torch.manual_seed(0)
    parallel = ParallelConfig(param_dtype="float32", **parallel_kwargs)
    arch = tiny_moe()
    model = sharded_model_config(arch, parallel).build()
    with torch.no_grad():
        model.init_states()
        for router in (m for m in model.modules() if isinstance(m, Qwen3VLRouter)):
            router.gate.weight.mul_(20.0)  # decisive routing: top-k margins far above fp32 rounding
    dims = parallel_dims(parallel, world)
    dp_rank, dp_size = (rank, world) if dims.fsdp_enabled else (0, 1)
    batches = _micro_batches(arch, dp_size)
    ref_loss, ref_grads, ref_stats = _reference(copy.deepcopy(model).double(), batches, arch.text.num_experts_per_tok)

    dims.build_mesh()
    parallelize(model, dims, parallel)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # as build_policy: gradients are summed over ranks
    losses = RouterLosses(model, MoEConfig(aux_loss_coef=AUX, z_loss_coef=Z), tp=parallel.tp)
    mine = [SimpleNamespace(cu_seqlens=batches[dp_rank][1], num_seqs=len(batches[dp_rank][5]))]
    losses.start(mine)
    losses.prepare(mine[0])
    (_full(_forward(model, batches[dp_rank])).sum() * 0).backward()  # only the attached router losses
    injected = torch.tensor(
        sum(
            AUX * r.stats.tokens / r.loss_inputs.step_tokens * float(r.stats.balance)
            + Z * float(r.stats.z_sum) / r.loss_inputs.step_tokens
            for r in losses.routers
        )
    )
    if dp_size > 1:
        dist.all_reduce(injected)
    assert abs(float(injected) - ref_loss) <= 1e-5 * abs(ref_loss), (float(injected), ref_loss)
    stats = losses.metrics()
    for key, value in ref_stats.items():
        assert abs(stats[key] - value) <= 1e-5 * max(abs(value), 1e-3), (key, stats[key], value)
    names = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in model.named_parameters()}
    checked = 0
    for name, ref in ref_grads.items():
        got = _full(names[name].grad) if names[name].grad is not None else None
        if ref is None:
            assert got is None or not got.any(), name
            continue
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        checked += 1
    assert checked > 10 and any("router" in n for n, g in ref_grads.items() if g is not None)


SCENARIOS = {
    "fsdp2_ep2_full_ac": {"dp_shard": 2, "ep": 2, "activation_checkpoint": "full"},
    "fsdp2": {"dp_shard": 2},
    "tp2": {"dp_shard": 1, "tp": 2},
}


def run_scenarios(rank: int, world: int, out_dir: str) -> None:
    results = {}
    for name, kwargs in SCENARIOS.items():
        try:
            router_losses_match_float64(rank, world, kwargs)
            results[name] = "ok"
        except Exception:  # recorded per scenario and asserted in the test process
            results[name] = traceback.format_exc()
        dist.barrier()
    if rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results))
