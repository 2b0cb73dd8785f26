"""Rank bodies for the 2-rank tests: each compares itself against a one-process reference
computed in the same process from the same seed, and raises on mismatch."""

from __future__ import annotations

import copy
import json
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from osvl.model import hf_tensor_specs, iter_hf_tensors, save_pretrained
from osvl.parallel import ParallelConfig, parallel_dims, parallelize, sharded_model_config
from tests.model.tiny import image_batch, tiny_config
from tests.parallel.live_bytes import LiveTensorBytes

GRIDS = [(1, 2, 2), (1, 4, 2), (1, 2, 4), (1, 2, 2)]


def _loss(model, batch, labels, n_global: int) -> torch.Tensor:
    ids, cu, pos, px, grid, _ = batch
    logits = _full(model(ids, cu_seqlens=cu, position_ids=pos, pixel_values=px, image_grid_thw=grid))
    return F.cross_entropy(logits.float(), labels, reduction="sum") / n_global


def _reference(model, arch):
    full = image_batch(arch, GRIDS)
    labels = torch.randint(0, arch.text.vocab_size, (full[0].shape[0],), generator=torch.Generator().manual_seed(7))
    loss = _loss(model, full, labels, labels.numel())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return full, labels, loss.detach(), grads


def _rank_batch(full, labels, docs):
    ids, cu, pos, px, grid, lengths = full
    starts = cu.tolist()
    patch_starts = [0]
    for t, h, w in grid.tolist():
        patch_starts.append(patch_starts[-1] + t * h * w)
    tok = torch.cat([torch.arange(starts[d], starts[d + 1]) for d in docs])
    pat = torch.cat([torch.arange(patch_starts[d], patch_starts[d + 1]) for d in docs])
    new_lengths = [lengths[d] for d in docs]
    new_cu = torch.tensor([0] + new_lengths).cumsum(0).to(torch.int32)
    return (ids[tok], new_cu, pos[:, tok], px[pat], grid[docs], new_lengths), labels[tok]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def data_parallel_matches_one_process(rank: int, world: int, parallel_kwargs: dict, moe: bool) -> None:
    torch.manual_seed(0)
    parallel = ParallelConfig(param_dtype="float32", **parallel_kwargs)
    arch = tiny_config(moe=moe)
    model = sharded_model_config(arch, parallel).build()
    with torch.no_grad():
        model.init_states()
    reference = copy.deepcopy(model)
    full, labels, ref_loss, ref_grads = _reference(reference, arch)

    dims = parallel_dims(parallel, world)
    dims.build_mesh()
    parallelize(model, dims, parallel)
    dp_rank, dp_size = (rank, world) if dims.fsdp_enabled else (0, 1)
    docs = [d for d in range(len(GRIDS)) if d % dp_size == dp_rank]
    batch, rank_labels = _rank_batch(full, labels, docs)
    loss = _loss(model, batch, rank_labels, labels.numel())
    loss.backward()
    total = _full(loss.detach()).clone()
    if dp_size > 1:
        dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss, rtol=1e-5, atol=1e-6)
    names = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in model.named_parameters()}
    checked = 0
    for name, ref in ref_grads.items():
        got = _full(names[name].grad)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        checked += 1
    assert checked == len(names) > 0


def dcp_round_trip_is_exact(rank: int, world: int, parallel_kwargs: dict, moe: bool, path: str) -> None:
    parallel = ParallelConfig(param_dtype="float32", **parallel_kwargs)
    arch = tiny_config(moe=moe)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = sharded_model_config(arch, parallel).build()
        with torch.no_grad():
            model.init_states()
        dims = parallel_dims(parallel, world)
        dims.build_mesh()
        models.append(parallelize(model, dims, parallel))
    saved, fresh = models
    dcp.save(saved.state_dict(), checkpoint_id=path)
    state = fresh.state_dict()
    before = {k: _full(v).clone() for k, v in state.items()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    expected = {k: _full(v) for k, v in saved.state_dict().items()}
    got = {k: _full(v) for k, v in fresh.state_dict().items()}
    assert got.keys() == expected.keys()
    assert any(not torch.equal(before[k], expected[k]) for k in expected)  # the load had work to do
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


SCENARIOS = {
    "fsdp2_dense": (data_parallel_matches_one_process, {"dp_shard": 2}, False),
    "fsdp2_moe_full_ac": (data_parallel_matches_one_process, {"dp_shard": 2, "activation_checkpoint": "full"}, True),
    "fsdp2_cpu_offload": (data_parallel_matches_one_process, {"dp_shard": 2, "cpu_offload": True}, False),
    "tp2_dense": (data_parallel_matches_one_process, {"dp_shard": 1, "tp": 2}, False),
    "tp2_moe": (data_parallel_matches_one_process, {"dp_shard": 1, "tp": 2}, True),
    "ep2_fsdp2_moe": (data_parallel_matches_one_process, {"dp_shard": 2, "ep": 2}, True),
    "dcp_fsdp2_ep2_moe": (dcp_round_trip_is_exact, {"dp_shard": 2, "ep": 2}, True),
    "dcp_tp2_dense": (dcp_round_trip_is_exact, {"dp_shard": 1, "tp": 2}, False),
}


# Streaming HF writes: (parallel plan, MoE, decoder layers, export dtype). Eight dense layers make one
# layer plus one file a small part of the model, so the memory bound can tell streaming from gathering.
HF_WRITES = {
    "hf_write_fsdp2_dense_bf16": ({"dp_shard": 2}, False, 8, torch.bfloat16),
    "hf_write_tp2_dense": ({"dp_shard": 1, "tp": 2}, False, 2, None),
    "hf_write_fsdp2_ep2_moe": ({"dp_shard": 2, "ep": 2, "activation_checkpoint": "full"}, True, 2, None),
}


def hf_write_arch(moe: bool, layers: int):
    arch = tiny_config(moe=moe)
    return replace(arch, text=replace(arch.text, num_hidden_layers=layers))


def streaming_hf_write(rank: int, world: int, name: str, out: str) -> None:
    """Writes ``out/<name>/hf`` from 2 ranks (rank 0 also saves the unsharded state for the parent's
    one-process write) and checks the stream order and this rank's peak of live gathered bytes."""
    kwargs, moe, layers, dtype = HF_WRITES[name]
    parallel = ParallelConfig(param_dtype="float32", **kwargs)
    arch = hf_write_arch(moe, layers)
    torch.manual_seed(0)
    model = sharded_model_config(arch, parallel).build()
    with torch.no_grad():
        model.init_states()
    root = Path(out) / name
    if rank == 0:
        root.mkdir(parents=True)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "unsharded.pt")
    dims = parallel_dims(parallel, world)
    dims.build_mesh()
    parallelize(model, dims, parallel)

    specs = hf_tensor_specs(model, dtype)
    streamed = [(n, tuple(t.shape), t.dtype) for n, t in iter_hf_tensors(model, dtype)]
    assert streamed == [(s.name, s.shape, s.dtype) for s in specs]
    total = sum(s.nbytes for s in specs)
    max_shard = total // 8
    units = {}
    for s in specs:  # HF bytes per conversion unit (a decoder layer, a vision block, or one tensor)
        unit = ".".join(s.name.split(".")[:4]) if ".layers." in s.name or ".blocks." in s.name else s.name
        units[unit] = units.get(unit, 0) + s.nbytes
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.state_dict().values()]
    with LiveTensorBytes(existing=local) as tracker:
        plan = save_pretrained(model, root / "hf", dtype=dtype, max_shard_bytes=max_shard)
    mine = [f for f in plan if f.owner == rank]
    assert mine, f"rank {rank} writes no file: {plan}"
    bound = 3 * max(units.values()) + max(f.nbytes for f in mine)  # one unit gathered and converted + one file
    assert tracker.peak <= bound, f"rank {rank}: peak {tracker.peak} B of live tensors > bound {bound} B"
    if layers >= 8:
        assert tracker.peak < total / 2, f"rank {rank}: peak {tracker.peak} B is not well below the model ({total} B)"
    (root / f"peak_rank{rank}.json").write_text(json.dumps({"peak": tracker.peak, "bound": bound, "total": total}))


def run_scenarios(rank: int, world: int, out_dir: str) -> None:
    """Every scenario and HF write on the same 2 ranks (one spawn); rank 0 records ok / traceback per
    scenario."""
    runs = {
        name: (fn, (kwargs, moe, *((str(Path(out_dir) / f"ckpt_{name}"),) if fn is dcp_round_trip_is_exact else ())))
        for name, (fn, kwargs, moe) in SCENARIOS.items()
    }
    runs.update({name: (streaming_hf_write, (name, out_dir)) for name in HF_WRITES})
    results = {}
    for name, (fn, args) in runs.items():
        try:
            fn(rank, world, *args)
            results[name] = "ok"
        except Exception:  # recorded per scenario and asserted in the test process
            results[name] = traceback.format_exc()
        dist.barrier()
    if rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results))
