"""The rollouts' event-loop thread: coroutines run there while the caller's thread works, results come
back, a coroutine cannot wait on its own loop, and closing cancels what still runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from osvl.rollout.event_loop import EventLoopThread


def test_coroutines_run_on_the_loop_thread_and_close_cancels_the_rest():
    cancelled = threading.Event()

    async def where() -> str:
        return threading.current_thread().name

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with EventLoopThread(name="osvl-test-loop") as loop:
        assert loop.run(where()) == "osvl-test-loop"
        pending = loop.submit(forever())
        seen = []
        loop.call(seen.append, 1)
        assert loop.run(asyncio.sleep(0, result="ok")) == "ok" and seen == [1]

        async def wait_on_itself() -> None:
            loop.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="wait on itself"):
            loop.run(wait_on_itself())
    assert cancelled.is_set() and pending.cancelled()
    loop.close()  # closing twice is harmless
