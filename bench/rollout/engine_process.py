"""An engine that owns its model in a server process: a crash is a real dead process.

``ProcessEngine`` speaks the ``Engine`` protocol in the caller's process and forwards each
request over a pipe to a server process that builds the engine with ``factory()`` (a picklable,
module-level callable) and runs its requests concurrently on an asyncio loop, so the local
engine still batches them. When the server dies, every request in flight fails with
``EngineError`` (the agent loop records ``infra_error``); the next request restarts the server,
which reloads the newest weights before serving.

Weights travel as a ``torch.save`` file (in ``/dev/shm`` when it exists, i.e. shared memory) plus
a policy version; the server loads them in place and acknowledges the version.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

from osvl.rollout.engine import EngineError, GenerationRequest, GenerationResult

EngineFactory = Callable[[], Any]  # returns an Engine; with ``load_weights(state, version)`` for updates


def shared_memory_dir() -> str:
    """tmpfs when available, so weight files never touch a disk."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def save_weights(state_dict: Mapping[str, torch.Tensor], version: int, directory: str | os.PathLike[str]) -> Path:
    """Atomically writes ``state_dict`` (CPU copies) to ``directory``; returns the file's path."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"policy version must be an integer >= 0, got {version!r}")
    if not state_dict:
        raise ValueError("a weight update needs a non-empty state dict")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"osvl-weights-v{version}-", suffix=".tmp", dir=directory)
    os.close(fd)
    torch.save({name: tensor.detach().cpu() for name, tensor in state_dict.items()}, tmp)
    path = Path(tmp).with_suffix(".pt")
    os.replace(tmp, path)
    return path


def load_weights_file(engine: Any, path: str, version: int) -> None:
    if not hasattr(engine, "load_weights"):
        raise ValueError(f"{type(engine).__name__} cannot take weight updates (no load_weights)")
    engine.load_weights(torch.load(path, map_location="cpu", weights_only=True), version)


def start_context(method: str) -> Any:
    """A clean-interpreter process context. The forkserver imports torch and osvl once, then forks
    each server or worker from that fresh process (never from the caller, whose threads and CUDA
    state must not be inherited), so a restart takes milliseconds instead of an import."""
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {method!r}")
    if method not in mp.get_all_start_methods():
        raise ValueError(f"start_method {method!r} is not available on this platform")
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["osvl.rollout"])
    return context


def spawn(context: Any, target: Callable[[Any, Any], None], factory: Any, name: str) -> tuple[Any, Any]:
    """A daemon child running ``target(conn, factory)``, and the parent's end of its pipe."""
    parent, child = context.Pipe(duplex=True)
    process = context.Process(target=target, args=(child, factory), daemon=True, name=name)
    process.start()
    child.close()
    return process, parent


def await_ready(process: Any, conn: Any, timeout_s: float, what: str, error: type[Exception]) -> Any:
    """The payload of the child's ``("ready", payload)`` hello; ``error`` if it stays silent, dies
    or reports a failure, so a broken factory fails the caller instead of hanging it."""
    try:
        if not conn.poll(timeout_s):
            raise error(f"{what} did not start within {timeout_s}s")
        kind, payload = conn.recv()
    except (EOFError, OSError):
        kind, payload = "failed", f"died while starting (exit code {process.exitcode})"
    if kind != "ready":
        raise error(f"{what} failed to start: {payload}")
    return payload


@dataclass(frozen=True)
class ProcessEngineConfig:
    startup_timeout_s: float = 120.0
    max_restarts: int = 8  # server crashes survived over the engine's life; then requests fail
    weights_dir: str | None = None  # None = shared memory (/dev/shm) or the temp dir
    start_method: str = "forkserver"  # "spawn" is the portable fallback

    def __post_init__(self) -> None:
        start_context(self.start_method)  # validates the name
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


def _server_main(conn: Any, factory: EngineFactory) -> None:
    try:
        engine = factory()
    except BaseException as error:  # noqa: BLE001 - the parent reports why the server never came up
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", engine.policy_version))
    asyncio.run(_serve(conn, engine))


async def _serve(conn: Any, engine: Any) -> None:
    send_lock = threading.Lock()
    tasks: set[asyncio.Task] = set()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    async def generate(request_id: int, request: GenerationRequest) -> None:
        try:
            send(("result", request_id, await engine.generate(request)))
        except ValueError as error:
            send(("error", request_id, "value", str(error)))
        except Exception as error:  # noqa: BLE001 - reported to the caller as an infra error
            send(("error", request_id, "engine", f"{type(error).__name__}: {error}"))

    async def update(request_id: int, path: str, version: int) -> None:
        try:
            await asyncio.to_thread(load_weights_file, engine, path, version)
            send(("result", request_id, version))
        except Exception as error:  # noqa: BLE001
            send(("error", request_id, "value", f"weight update failed: {type(error).__name__}: {error}"))

    while True:
        try:
            message = await asyncio.to_thread(conn.recv)
        except (EOFError, OSError):
            return  # the client is gone
        if message is None:
            return
        kind, request_id, *payload = message
        coroutine = generate(request_id, *payload) if kind == "generate" else update(request_id, *payload)
        task = asyncio.create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class ProcessEngine:
    """``Engine`` client for a server process built by ``factory``; thread- and loop-agnostic."""

    def __init__(self, factory: EngineFactory, config: ProcessEngineConfig | None = None) -> None:
        self.factory = factory
        self.config = config or ProcessEngineConfig()
        self.restarts = 0
        self._ctx = start_context(self.config.start_method)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the connection and the pending map
        self._restart_lock = threading.Lock()
        self._live_conn: Any = None  # the connection a reader thread still serves
        self._pending: dict[int, Future] = {}
        self._process: Any = None
        self._conn: Any = None
        self._version = 0
        self._weights: tuple[str, int] | None = None  # newest update, replayed into a restarted server
        self._closed = False
        self._start()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _start(self) -> None:
        process, parent = spawn(self._ctx, _server_main, self.factory, "osvl-engine-server")
        try:
            version = await_ready(process, parent, self.config.startup_timeout_s, "engine server", EngineError)
        except EngineError:
            process.kill()
            process.join(5)
            raise
        with self._lock:
            self._process, self._conn, self._live_conn = process, parent, parent
        self._version = version
        threading.Thread(target=self._read, args=(parent, process), daemon=True, name="osvl-engine-reader").start()
        if self._weights is not None:
            self._call(("weights", *self._weights)).result()
            self._version = self._weights[1]

    def _read(self, conn: Any, process: Any) -> None:
        while True:
            try:
                kind, request_id, *payload = conn.recv()
            except (EOFError, OSError):
                conn.close()
                break
            with self._lock:
                future = self._pending.pop(request_id, None)
            if future is None or future.cancelled():  # the caller gave up (deadline)
                continue
            if kind == "result":
                future.set_result(payload[0])
            else:
                error_kind, message = payload
                future.set_exception(ValueError(message) if error_kind == "value" else EngineError(message))
        process.join(1)
        with self._lock:
            if self._live_conn is conn:
                self._live_conn = None
            orphans = list(self._pending.values())
            self._pending.clear()
        for future in orphans:
            if not future.cancelled():
                future.set_exception(EngineError(f"engine server {process.pid} died (exit code {process.exitcode})"))

    def _ensure_running(self) -> None:
        with self._restart_lock:
            if self._closed:
                raise EngineError("the engine is closed")
            if self.alive():
                return
            if self.restarts >= self.config.max_restarts:
                raise EngineError(f"engine server is dead and used its {self.config.max_restarts} restarts")
            self.restarts += 1
            self._start()

    def _call(self, message: tuple) -> Future:
        future: Future = Future()
        with self._lock:
            if self._live_conn is None or self._live_conn is not self._conn:
                future.set_exception(EngineError("engine server is down"))
                return future
            request_id = next(self._ids)
            self._pending[request_id] = future
            try:
                self._conn.send((message[0], request_id, *message[1:]))
            except (BrokenPipeError, OSError) as error:
                self._pending.pop(request_id, None)
                future.set_exception(EngineError(f"engine server unreachable: {error}"))
        return future

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not self.alive():
            await asyncio.to_thread(self._ensure_running)
        return await asyncio.wrap_future(self._call(("generate", request)))

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Blocks until the server holds ``version``; a bad update raises ValueError and changes nothing."""
        path = save_weights(state_dict, version, self.config.weights_dir or shared_memory_dir())
        try:
            self._ensure_running()
            self._call(("weights", str(path), version)).result()
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        previous, self._weights, self._version = self._weights, (str(path), version), version
        if previous is not None and previous[0] != str(path):
            Path(previous[0]).unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the server (tests and operators simulating a crash); requests in flight fail."""
        if self._process is not None:
            self._process.kill()
            self._process.join(10)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        if self._process is not None:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        if self._weights is not None:
            Path(self._weights[0]).unlink(missing_ok=True)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
