"""An asyncio event loop on its own thread.

Asynchronous GRPO rolls out while the trainer trains: the rollouts' coroutines (engine requests,
tool calls, judges) run on this loop while the caller's thread runs the forward and backward
passes (torch releases the GIL in its kernels). ``run`` blocks the caller until a coroutine is
done (the weight syncs, the pre-flight and validation use it as their ``Runner``), so every
coroutine of a stage, and every client bound to a loop (httpx), lives on this one loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Self, TypeVar

T = TypeVar("T")


class EventLoopThread:
    """``with EventLoopThread() as loop: loop.run(coro)``; ``close`` cancels what is still running."""

    def __init__(self, name: str = "osvl-rollouts") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """The coroutine's result, computed on the loop; the calling thread waits for it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EventLoopThread.run called from its own loop: it would wait on itself")
        return self.submit(coro).result()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the loop's thread, soon (it must not block)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        self.submit(drain()).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
