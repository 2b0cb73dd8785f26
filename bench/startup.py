"""The policy's start-up on N CPU ranks: seconds and each rank's host high-water mark while it builds
the policy from an HF checkpoint, the trainer's start-up (meta model, plan applied there, each rank
allocating and reading only its own shards) against the former one (every rank built the whole float32
model, loaded a second whole copy from every tensor of every file, then sharded), in one run.

    python -m bench.startup                       # a ~270M-parameter bf16 checkpoint, 2 and 4 ranks
    python -m bench.startup --smoke               # a small one, 2 ranks (tests/bench runs it)

Growth is VmHWM minus the rank's RSS just before the build (Linux ``clear_refs`` resets the mark), in
units of the rank's float32 shard. Writes ``<out-dir>/<name>-cpu-<commit>.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path[0] = str(REPO)

import torch  # noqa: E402

from bench.kernels.report import git_info, result_path, versions, write_record  # noqa: E402

SCHEMA = "osvl.bench.startup/1"
MODES = ("sharded", "whole")


# --- measuring a rank ----------------------------------------------------------------------------


def host_memory() -> dict[str, int]:
    """This process's resident bytes now (VmRSS) and its high-water mark (VmHWM)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def reset_high_water_mark() -> int:
    """Frees what the allocator holds, resets VmHWM to the current RSS and returns that RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return host_memory()["VmRSS"]


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """float32 bytes of this rank's part of every parameter (each once)."""
    from torch.distributed.tensor import DTensor

    unique = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in unique)


# --- the checkpoint ------------------------------------------------------------------------------


def startup_arch(vocab_size: int, special, *, hidden: int = 1024, layers: int = 16):
    """A Qwen3-VL of ~270M parameters (hidden 1024, 16 layers) whose vision ids are the tokenizer's,
    vocabulary padded to 32768."""
    from osvl.trainer.policy import tiny_arch

    arch = tiny_arch(vocab_size, special)
    text = dataclasses.replace(
        arch.text,
        vocab_size=max(32768, vocab_size),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=hidden // 16,
        mrope_section=(hidden // 64, hidden // 128, hidden // 128),
    )
    return dataclasses.replace(arch, text=text, vision=dataclasses.replace(arch.vision, out_hidden_size=hidden))


def write_checkpoint(arch, path: Path, *, max_shard_bytes: int = 256 * 2**20, seed: int = 0) -> int:
    """An HF checkpoint of ``arch`` in bfloat16, written file by file (never the whole model in memory),
    values seeded normals; returns its parameter count."""
    from safetensors.torch import save_file

    from osvl.model import build_model, config_to_hf, hf_tensor_specs, shard_plan
    from osvl.model.checkpoint import INDEX_FILE

    path.mkdir(parents=True, exist_ok=True)
    specs = hf_tensor_specs(build_model(arch, device="meta"), torch.bfloat16)
    plan = shard_plan(specs, 1, max_shard_bytes)
    shapes = {s.name: s.shape for s in specs}
    generator = torch.Generator().manual_seed(seed)
    for file in plan:
        tensors = {n: (torch.randn(shapes[n], generator=generator) * 0.02).bfloat16() for n in file.tensors}
        save_file(tensors, str(path / file.name), metadata={"format": "pt"})
        del tensors
    (path / "config.json").write_text(json.dumps(config_to_hf(arch, dtype="bfloat16"), indent=2))
    if len(plan) > 1:
        weight_map = {n: f.name for f in plan for n in f.tensors}
        index = {"metadata": {"total_size": sum(f.nbytes for f in plan)}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return sum(math.prod(s.shape) for s in specs)


def write_tokenizer(path: Path):
    """A small BPE tokenizer (its ids set the vision ids of the checkpoint's config)."""
    from osvl.data.tokenizer import train_bpe_tokenizer

    corpus = ["the policy starts from a checkpoint", "each rank reads its own shard"] * 8
    tokenizer = train_bpe_tokenizer(corpus, vocab_size=384)
    tokenizer.save(path)
    return tokenizer


# --- the two start-ups ---------------------------------------------------------------------------


def whole_startup(recipe, arch, world: int) -> torch.nn.Module:
    """The former start-up: the whole float32 model, a second whole copy loaded from every tensor of every
    file (converted to float32 in one dict), copied over, and only then the parallel plan."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from osvl.model import build_model, from_hf_state_dict, read_hf_tensors
    from osvl.parallel import parallel_dims, parallelize, sharded_model_config

    model = sharded_model_config(arch, recipe.parallel).build()
    copy = build_model(arch, init=False)
    state = from_hf_state_dict(read_hf_tensors(recipe.model.pretrained), arch)
    copy.load_state_dict({k: t.to(torch.float32) for k, t in state.items()}, strict=True)
    del state
    model.load_state_dict(copy.state_dict(), strict=True)
    del copy
    if dist.is_initialized():
        dims = parallel_dims(recipe.parallel, world)
        dims.build_mesh()
        parallelize(model, dims, recipe.parallel)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
    return model


def rank_body(rank: int, world: int, mode: str, overrides: list[str], out: str) -> None:
    """One rank's start-up in ``mode``: seconds, host growth, its float32 shard."""
    from osvl.config import load_recipe
    from osvl.data.tokenizer import load_tokenizer
    from osvl.trainer.policy import build_policy, policy_arch

    recipe = load_recipe("tiny_sft", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    baseline = reset_high_water_mark()
    start = time.perf_counter()
    model = build_policy(recipe, arch, world) if mode == "sharded" else whole_startup(recipe, arch, world)
    seconds = time.perf_counter() - start
    growth = host_memory()["VmHWM"] - baseline
    record = {"rank": rank, "seconds": seconds, "growth_bytes": growth, "shard_bytes": local_parameter_bytes(model)}
    Path(out, f"{mode}_rank{rank}.json").write_text(json.dumps(record))


def _entry(rank: int, world: int, port: int, mode: str, overrides: list[str], out: str) -> None:
    import os

    import torch.distributed as dist

    from osvl.parallel import teardown, use_host_device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    use_host_device()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rank_body(rank, world, mode, overrides, out)
    finally:
        teardown()


def run_world(world: int, mode: str, overrides: list[str], out: Path) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _entry, args=(world, port, mode, overrides, str(out)), nprocs=world, join=True, start_method="spawn"
    )
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="hidden 256, 2 layers, 2 ranks")
    p.add_argument("--worlds", default=None, help="comma-separated rank counts (default 2,4; 2 with --smoke)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--name", default="startup")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    worlds = [int(w) for w in (args.worlds or ("2" if args.smoke else "2,4")).split(",")]
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes takes {MODES}")
    git = git_info(REPO)
    with tempfile.TemporaryDirectory(prefix="osvl_startup_") as scratch:
        root = Path(scratch)
        tokenizer = write_tokenizer(root / "tokenizer.json")
        size = dict(hidden=256, layers=2) if args.smoke else {}
        arch = startup_arch(tokenizer.vocab_size, tokenizer.special, **size)
        params = write_checkpoint(arch, root / "checkpoint")
        overrides = [f"data.tokenizer={root / 'tokenizer.json'}", f"model.pretrained={root / 'checkpoint'}"]
        runs = []
        for world in worlds:
            for mode in modes:
                out = root / f"{mode}_{world}"
                out.mkdir()
                ranks = run_world(world, mode, overrides, out)
                shard = max(r["shard_bytes"] for r in ranks)
                runs.append(
                    {
                        "world": world,
                        "mode": mode,
                        "ranks": ranks,
                        "seconds_max": max(r["seconds"] for r in ranks),
                        "growth_max_bytes": max(r["growth_bytes"] for r in ranks),
                        "growth_over_shard_max": max(r["growth_bytes"] / r["shard_bytes"] for r in ranks),
                        "shard_bytes": shard,
                    }
                )
                print(
                    f"world {world} {mode:8s}: {runs[-1]['seconds_max']:.2f} s, host growth "
                    f"{runs[-1]['growth_max_bytes'] / 2**20:.0f} MiB = {runs[-1]['growth_over_shard_max']:.2f}x the "
                    f"rank's float32 shard ({shard / 2**20:.0f} MiB)"
                )
    record = {
        "schema": SCHEMA,
        "name": args.name,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git,
        "device": {"type": "cpu", "name": "cpu"},
        "versions": versions(),
        "checkpoint": {
            "params": params,
            "dtype": "bfloat16",
            "hidden": arch.text.hidden_size,
            "layers": arch.text.num_hidden_layers,
        },
        "runs": runs,
    }
    path = result_path(Path(args.out_dir), args.name, "cpu", git["short"])
    write_record(record, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
