"""Weight sync: after every optimizer step the engines serve the trainer's new weights.

The policy version is the number of optimizer steps taken; every sync ends with the engines
reporting that version, or it fails naming the engine (a silent skew would train on one policy
while sampling from another). Three ways, one interface (``sync`` is collective over the trainer's
ranks; only rank 0 talks to the servers, and its outcome reaches every rank):

- ``InProcessSync``: the local engine (CPU form) takes the gathered state dict in memory;
- ``DiskSync``: the ranks write HF safetensors collectively (each rank its own shard file) into a
  shared directory, keeping the last ``keep`` versions, then every server loads it (SGLang:
  ``/update_weights_from_disk``; vLLM: pause, ``reload_weights`` through ``/collective_rpc``,
  resume, the path that works on CPU) and must report the version;
- ``DistributedSync``: rank 0 joins a weights-update group with the SGLang servers and broadcasts
  the HF-named tensors in buckets of ``bucket_bytes`` (``/update_weights_from_distributed`` inside
  one ``/begin_weight_update`` ... ``/end_weight_update`` session), gathered one layer at a time
  from the shards;
- ``VLLMNCCLSync``: the same stream into vLLM servers through vLLM's RL API (NCCL, GPUs only).

``text_only``: the servers serve the language model alone as a Qwen3 text checkpoint
(:mod:`osvl.model.text_export`; vLLM's CPU build, which cannot run the vision tower).

With ``pause`` (asynchronous GRPO on SGLang servers: they generate while the trainer trains) rank 0
pauses generation on every server (``/pause_generation``, abort mode) before the first byte moves
and continues it after the version is confirmed, so no request ever runs on half-updated weights (a
bucketed update is many calls). The in-process engine needs no pause: it swaps the whole state
between two batches under its lock; vLLM's disk update pauses (``/pause?mode=wait``) itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import shutil
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from osvl.model.checkpoint import iter_hf_tensors, save_pretrained
from osvl.rollout.engine import EngineError
from osvl.rollout.local_engine import LocalEngine
from osvl.rollout.sglang import SGLangEngine
from osvl.rollout.vllm import VLLMEngine

T = TypeVar("T")
Runner = Callable[[Coroutine[Any, Any, T]], T]  # runs a coroutine on the stage's event loop


@dataclass(frozen=True)
class SyncStats:
    seconds: float
    bytes: int  # weight bytes one server received


class WeightSync(Protocol):
    def sync(self, model: torch.nn.Module, version: int) -> SyncStats: ...

    def close(self) -> None: ...


class DiskLoader(Protocol):
    """A fleet of servers that load an HF directory and then report ``version`` (SGLang, vLLM)."""

    async def update_weights_from_disk(self, model_path: str, version: int) -> None: ...


def update_group_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """The store view of a weights-update group as SGLang's side of it sees it: its
    ``init_custom_process_group`` prefixes the group name, then torch's ``_new_process_group_helper``
    adds ``"{group_name}/"`` and the device its backend serves (``cpu/`` for gloo, ``cuda/`` for
    NCCL). Both sides must build their backend on the same keys, or the group never forms."""
    device = "cpu" if backend == "gloo" else "cuda"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _message(error: Exception) -> str:
    return str(error) if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"


def _agree(error: str | None) -> None:
    """Rank 0's outcome on every rank: all ranks raise together, none is left in a collective."""
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise EngineError(error)


@contextlib.contextmanager
def _paused(engine: SGLangEngine, run: Runner, pause: bool):
    """Generation paused on every server for the block (when ``pause``), continued whatever happens."""
    if not pause:
        yield
        return
    run(engine.pause_generation())
    try:
        yield
    finally:
        run(engine.continue_generation())


class InProcessSync:
    """Gathers the full (unsharded) weights on every rank into that rank's local engine."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        start = time.perf_counter()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        self.engine.load_weights({k: v.detach() for k, v in full.items()}, version)
        nbytes = sum(v.numel() * v.element_size() for v in full.values())
        return SyncStats(time.perf_counter() - start, nbytes)

    def close(self) -> None:
        pass


class DiskSync:
    """HF safetensors into ``directory/v{version:06d}``, loaded by every server from there."""

    def __init__(
        self,
        engine: DiskLoader,
        directory: str | Path,
        dtype: torch.dtype,
        run: Runner,
        keep: int = 2,
        text_only: bool = False,
        pause: bool = False,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.engine, self.directory, self.dtype, self.run, self.keep = engine, Path(directory), dtype, run, keep
        self.text_only, self.pause = text_only, pause

    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        start = time.perf_counter()
        path = self.directory / f"v{version:06d}"
        # collective; returns once every shard is on disk
        files = save_pretrained(model, path, dtype=self.dtype, text_only=self.text_only)
        error = None
        if _rank() == 0:
            try:
                with _paused(self.engine, self.run, self.pause):
                    self.run(self.engine.update_weights_from_disk(str(path.resolve()), version))
            except Exception as failure:  # noqa: BLE001 - whatever stops rank 0 must reach every rank
                error = _message(failure)
            else:
                for old in sorted(self.directory.glob("v*"))[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        _agree(error)
        return SyncStats(time.perf_counter() - start, sum(f.nbytes for f in files))

    def close(self) -> None:
        pass


class DistributedSync:
    """Bucketed broadcasts from trainer rank 0 to every server's ranks (gloo on CPU, NCCL on GPUs)."""

    def __init__(
        self,
        engine: SGLangEngine,
        dtype: torch.dtype,
        run: Runner,
        *,
        bucket_bytes: int,
        master_address: str,
        master_port: int = 0,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        text_only: bool = False,
        pause: bool = False,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.engine, self.dtype, self.run, self.bucket_bytes = engine, dtype, run, bucket_bytes
        self.text_only, self.pause = text_only, pause
        self.master_address, self.master_port, self.backend, self.timeout_s = (
            master_address,
            master_port,
            backend,
            timeout_s,
        )
        self.group_name = f"osvl-weights-{uuid.uuid4().hex[:8]}"
        self._group: Any = None

    def _connect(self) -> None:
        """Rank 0 opens the store, the servers join, and rank 0 becomes rank 0 of the group."""
        sizes = self.run(self.engine.server_ranks())
        world = 1 + sum(sizes)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(
            self.master_address, self.master_port, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        prefixed = update_group_store(store, self.group_name, self.backend)

        def create() -> Any:
            if self.backend == "gloo":
                return dist.ProcessGroupGloo(prefixed, 0, world, timeout)
            return dist.ProcessGroupNCCL(prefixed, 0, world)

        async def join() -> Any:
            joined = asyncio.create_task(
                self.engine.init_weights_update_group(
                    self.master_address, store.port, self.group_name, self.backend, sizes
                )
            )
            group = await asyncio.to_thread(create)
            await joined
            return group

        self._group = self.run(join())
        self._store = store

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        def broadcast() -> None:
            for _, tensor in bucket:
                self._group.broadcast([tensor.contiguous()]).wait()

        async def both() -> None:
            announced = asyncio.create_task(
                self.engine.update_weights_from_distributed(
                    [n for n, _ in bucket],
                    [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    [list(t.shape) for _, t in bucket],
                    self.group_name,
                    version,
                )
            )
            await asyncio.to_thread(broadcast)
            await announced

        self.run(both())

    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        start = time.perf_counter()
        lead = _rank() == 0
        error, nbytes = None, 0
        if lead and self._group is None:
            try:
                self._connect()
            except Exception as failure:  # noqa: BLE001
                error = f"weights update group: {_message(failure)}"
        elif lead:
            try:
                lost = self.run(self.engine.lost_servers())
            except Exception as failure:  # noqa: BLE001
                error = _message(failure)
            else:
                if lost:
                    error = (
                        "SGLang server(s) restarted since the last weight sync and left the weights update group: "
                        + "; ".join(f"{url} reports weight version {v!r}" for url, v in lost.items())
                        + ". With rollout.weight_sync = 'distributed' the trainer has no copy to give them outside a "
                        "step: relaunch the trainer, which resumes from its newest checkpoint and pushes its weights "
                        "first (or use rollout.weight_sync = 'disk', from which a restarted server gets them back)"
                    )
        paused = opened = False
        if lead and error is None and self.pause:
            try:
                self.run(self.engine.pause_generation())
                paused = True
            except Exception as failure:  # noqa: BLE001
                error = _message(failure)
        if lead and error is None:
            try:
                self.run(self.engine.begin_weight_update())
                opened = True
            except Exception as failure:  # noqa: BLE001
                error = _message(failure)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        # collective: every rank gathers every layer
        for name, tensor in iter_hf_tensors(model, self.dtype, text_only=self.text_only):
            if not lead or error is not None:
                continue
            if bucket and size + tensor.numel() * tensor.element_size() > self.bucket_bytes:
                try:
                    self._send(bucket, None)
                except Exception as failure:  # noqa: BLE001
                    error = _message(failure)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            nbytes += tensor.numel() * tensor.element_size()
        if lead and error is None:
            try:
                self._send(bucket, version)  # the last bucket carries the version
            except Exception as failure:  # noqa: BLE001
                error = _message(failure)
        if opened:  # closed whatever happened, or the server refuses the next session
            try:
                self.run(self.engine.end_weight_update())
            except Exception as failure:  # noqa: BLE001
                error = error or _message(failure)
        if lead and error is None:
            try:
                self.run(self.engine.confirm_version(version))
            except Exception as failure:  # noqa: BLE001
                error = _message(failure)
        if paused:
            try:
                self.run(self.engine.continue_generation())
            except Exception as failure:  # noqa: BLE001
                error = error or _message(failure)
        _agree(error)
        return SyncStats(time.perf_counter() - start, nbytes)

    def close(self) -> None:
        if self._group is not None:
            try:
                self.run(self.engine.destroy_weights_update_group(self.group_name))
            except EngineError:
                pass
            self._group = None


class VLLMNCCLSync:
    """Bucketed NCCL broadcasts from trainer rank 0 into vLLM servers through vLLM's RL API.

    The group is joined with a pre-shared NCCL unique id (vLLM's torch-free rendezvous), so the
    trainer needs no vLLM: rank 0 mints the id, every server joins over HTTP while rank 0 joins with
    ``torch.cuda.nccl``, and all issue the one-element all-reduce vLLM's communicator expects first.
    Each sync: pause and ``/start_weight_update``, one ``/update_weights`` per bucket (announced,
    then broadcast tensor by tensor), ``/finish_weight_update`` with the version, resume. GPUs only.
    """

    def __init__(
        self, engine: VLLMEngine, dtype: torch.dtype, run: Runner, *, bucket_bytes: int, text_only: bool = False
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.engine, self.dtype, self.run, self.bucket_bytes = engine, dtype, run, bucket_bytes
        self.text_only = text_only
        self._comm: Any = None

    def _connect(self) -> None:
        import torch.cuda.nccl as nccl

        if not torch.cuda.is_available():
            raise EngineError("rollout.weight_sync = 'distributed' into vLLM needs CUDA (NCCL); use 'disk' on CPU")
        sizes = self.run(self.engine.server_ranks())
        unique_id = nccl.unique_id()

        def join() -> Any:
            comm = nccl.init_rank(1 + sum(sizes), unique_id, 0)
            warm = torch.zeros(1, device="cuda")
            nccl.all_reduce([warm], comms=[comm])  # vLLM's communicator starts with this collective
            torch.cuda.synchronize()
            return comm

        async def both() -> Any:
            joined = asyncio.create_task(self.engine.init_weight_transfer(unique_id, sizes))
            comm = await asyncio.to_thread(join)
            await joined
            return comm

        self._comm = self.run(both())

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        import torch.cuda.nccl as nccl

        def broadcast() -> None:
            for _, tensor in bucket:
                nccl.broadcast([tensor.contiguous()], root=0, comms=[self._comm])
            torch.cuda.synchronize()

        async def both() -> None:
            announced = asyncio.create_task(
                self.engine.update_weights(
                    [n for n, _ in bucket],
                    [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    [list(t.shape) for _, t in bucket],
                )
            )
            await asyncio.to_thread(broadcast)
            await announced

        self.run(both())

    def sync(self, model: torch.nn.Module, version: int) -> SyncStats:
        start = time.perf_counter()
        lead = _rank() == 0
        error, nbytes = None, 0
        if lead:
            try:
                if self._comm is None:
                    self._connect()
                self.run(self.engine.start_weight_update())
            except Exception as failure:  # noqa: BLE001 - whatever stops rank 0 must reach every rank
                error = f"vLLM weight transfer: {_message(failure)}"
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in iter_hf_tensors(model, self.dtype, text_only=self.text_only):  # collective
            if not lead or error is not None:
                continue
            if bucket and size + tensor.numel() * tensor.element_size() > self.bucket_bytes:
                try:
                    self._send(bucket)
                except Exception as failure:  # noqa: BLE001
                    error = _message(failure)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            nbytes += tensor.numel() * tensor.element_size()
        if lead and error is None:
            try:
                self._send(bucket)
                self.run(self.engine.finish_weight_update(version))
            except Exception as failure:  # noqa: BLE001
                error = _message(failure)
        _agree(error)
        return SyncStats(time.perf_counter() - start, nbytes)

    def close(self) -> None:
        if self._comm is not None:
            try:
                self.run(self.engine.shutdown_weight_transfer())
            except EngineError:
                pass
            self._comm = None
