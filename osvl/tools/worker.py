"""The code that runs inside a tool worker process, and the exception-to-status mapping.

``run_job`` is also what in-process callers (the HTTP tool server, tests of single tools) use, so
a tool behaves the same with or without the pool. A worker imports its pool's known targets before
it reports ready: an import (torch, a model, a corpus) is start-up time, never a call's deadline.
"""

from __future__ import annotations

import importlib
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from osvl.rl.trajectory import ToolStatus, check_image
from osvl.tools.config import ToolBackendsConfig
from osvl.tools.errors import BackendError, CallParseError, ToolError, error_status
from osvl.tools.registry import ToolOutput
from osvl.tools.sandbox import own_sandbox_session

OUT_OF_MEMORY = "the tool ran out of memory"
Reply = tuple[ToolStatus, str, list[np.ndarray], str | None]
_TARGETS: dict[str, Callable[..., ToolOutput] | Exception] = {}


def resolve_target(target: str) -> Callable[..., ToolOutput]:
    """Import ``module:function`` once per process; a failed import is remembered and raised again,
    so every call to a broken tool gets the same error without paying for the import twice."""
    if target not in _TARGETS:
        module_name, _, attr = target.partition(":")
        try:
            _TARGETS[target] = getattr(importlib.import_module(module_name), attr)
        except Exception as err:  # noqa: BLE001 - reported to each call of this tool by run_job
            _TARGETS[target] = err
    resolved = _TARGETS[target]
    if isinstance(resolved, Exception):
        raise resolved.with_traceback(None)
    return resolved


def preload_targets(targets: Iterable[str]) -> dict[str, str]:
    """Import every target now; returns ``{target: error}`` for those that failed (calls to them
    will get the same error as a ``tool failed`` infra error)."""
    failed = {}
    for target in targets:
        try:
            resolve_target(target)
        except Exception as err:  # noqa: BLE001 - a broken tool must not stop the worker starting
            failed[target] = f"{type(err).__name__}: {err}"
    return failed


def run_job(
    target: str,
    arguments: Mapping[str, Any],
    images: list[np.ndarray],
    config: ToolBackendsConfig,
    options: Mapping[str, Any] | None = None,
) -> Reply:
    """Run one tool call; every failure becomes a status with a message, never an exception."""
    try:
        output = resolve_target(target)(arguments, images, config, **(options or {}))
    except (ToolError, CallParseError, BackendError) as err:
        return error_status(err), "", [], str(err)
    except MemoryError:
        return ToolStatus.INFRA_ERROR, "", [], OUT_OF_MEMORY
    except Exception as err:  # a bug or a broken backend is our fault, not the policy's
        return ToolStatus.INFRA_ERROR, "", [], f"tool failed: {type(err).__name__}: {err}"
    if not isinstance(output, ToolOutput):
        return ToolStatus.INFRA_ERROR, "", [], f"tool returned {type(output).__name__}, not ToolOutput"
    for image in output.images:
        try:
            check_image(image)
        except ValueError as err:
            return ToolStatus.INFRA_ERROR, "", [], f"tool produced an invalid image: {err}"
        pixels = image.shape[0] * image.shape[1]
        if pixels > config.limits.max_image_pixels:
            return (
                ToolStatus.TOOL_ERROR,
                "",
                [],
                f"the result would be {image.shape[1]}x{image.shape[0]} = {pixels} pixels, over the "
                f"limit of {config.limits.max_image_pixels}; crop or downscale the input first",
            )
    return ToolStatus.OK, output.text, output.images, None


def _apply_address_space_limit(limit_bytes: int | None) -> None:
    if limit_bytes is None:
        return
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def worker_main(
    conn: Connection,
    config: ToolBackendsConfig,
    address_space_bytes: int | None,
    opencv_threads: int = 1,
    preload: tuple[str, ...] = (),
) -> None:
    """Import ``preload``, report ``("ready", (pid, import errors))``, then serve
    ``(job_id, target, arguments, images, options)`` requests until the pipe closes or ``None`` arrives."""
    own_sandbox_session()  # the pool kills this session when it loses the worker: no sandbox run outlives it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    try:  # the image tools' threads; a text-only tool needs no OpenCV (a GPU image may lack it)
        import cv2
    except ImportError:
        pass
    else:
        cv2.setNumThreads(opencv_threads)
    _apply_address_space_limit(address_space_bytes)  # imports run under the same limit as calls
    conn.send(("ready", (os.getpid(), preload_targets(preload))))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job_id, target, arguments, images, options = message
        status, text, out_images, error = run_job(target, arguments, images, config, options)
        retire = error == OUT_OF_MEMORY  # a process that hit its memory limit is not trusted again
        try:
            conn.send((job_id, status.value, text, out_images, error, retire))
        except (BrokenPipeError, OSError):
            return
        if retire:
            return
