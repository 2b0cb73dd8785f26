"""Spawn N gloo ranks on loopback for a module-level worker function; failures re-raise here."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from osvl.parallel import teardown, use_host_device

    use_host_device()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        teardown()


def run_ranks(fn, world: int, *args) -> None:
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="spawn")
