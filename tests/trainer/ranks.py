"""Spawn N gloo ranks on a free loopback port; the body runs under an initialised process group."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from osvl.parallel import teardown, use_host_device

    use_host_device()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        teardown()


def run_ranks(fn, world: int, *args) -> None:
    mp.start_processes(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True, start_method="spawn")


def sft_resume_body(rank: int, world: int, overrides_a: list[str], overrides_b: list[str]) -> None:
    """Run A: 4 steps straight. Run B: 2 steps, 'crash', then resume to 4."""
    from osvl.config import load_recipe
    from osvl.trainer import run_sft

    a = run_sft(load_recipe("tiny_sft", overrides_a), rank, world)
    assert a.steps == 4 and a.resumed_from == 0, a
    first = run_sft(load_recipe("tiny_sft", overrides_b), rank, world, stop_after=2)
    assert first.steps == 2, first
    second = run_sft(load_recipe("tiny_sft", overrides_b), rank, world)
    assert second.steps == 4 and second.resumed_from == 2, second


def grpo_body(rank: int, world: int, overrides: list[str]) -> None:
    """A few GRPO steps of the scripted policy against echo tools with injected faults."""
    from osvl.config import load_recipe
    from osvl.trainer import run_grpo
    from tests.trainer.grpo_fixtures import echo_environment, scripted

    result = run_grpo(load_recipe("tiny_grpo", overrides), rank, world, environment=echo_environment,
                      engine_wrapper=scripted)
    assert result.steps == 2 and result.resumed_from == 0, result
