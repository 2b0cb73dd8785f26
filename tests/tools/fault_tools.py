"""Tools that misbehave on purpose, importable by spawned workers as ``tests.tools.fault_tools``."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from osvl.tools.errors import BackendError, ToolError
from osvl.tools.registry import ToolOutput, ToolSpec

_OBJECT = {
    "type": "object",
    "properties": {
        "tag": {"type": "string", "maxLength": 64},
        "seconds": {"type": "number", "minimum": 0, "maximum": 60},
        "image": {"type": "integer", "minimum": 0},
    },
}


def echo(arguments, images, config):
    """Return the caller's tag and its image plus one, so any mix-up between callers shows."""
    time.sleep(arguments.get("seconds", 0.0))
    return ToolOutput(
        text=f"echo:{arguments.get('tag', '')}:pid={os.getpid()}",
        images=[(image + 1).astype(np.uint8) for image in images],
    )


def hang(arguments, images, config):
    while True:
        time.sleep(0.05)


def abort(arguments, images, config):
    os.abort()


def leak(arguments, images, config):
    """Grow the RSS by ~16 MiB per step until someone stops us."""
    hoard = []
    while True:
        hoard.append(np.ones(16 << 20, dtype=np.uint8))
        time.sleep(0.005)


def huge_allocation(arguments, images, config):
    return ToolOutput(text=str(np.ones(64 << 30, dtype=np.uint8).sum()))


def refuse(arguments, images, config):
    raise ToolError("this call is wrong in a way the model can fix")


def backend_down(arguments, images, config):
    raise BackendError("upstream service unavailable")


def buggy(arguments, images, config):
    return {}["missing"]


def bad_image(arguments, images, config):
    return ToolOutput(images=[np.zeros((4, 4), dtype=np.float32)])


def _spec(name: str, fn: str, **kw) -> ToolSpec:
    return ToolSpec(
        name=name, description=f"test tool {name}", parameters=_OBJECT, target=f"tests.tools.fault_tools:{fn}", **kw
    )


def fault_specs() -> list[ToolSpec]:
    return [
        _spec("echo", "echo"),
        _spec("echo_image", "echo", image_args=("image",)),
        _spec("cached_echo", "echo", image_args=("image",), cacheable=True),
        _spec("hang", "hang", deadline_s=0.5),
        _spec("abort", "abort"),
        _spec("leak", "leak"),
        _spec("huge_allocation", "huge_allocation"),
        _spec("refuse", "refuse"),
        _spec("backend_down", "backend_down"),
        _spec("buggy", "buggy"),
        _spec("bad_image", "bad_image"),
    ]


def echo_options(arguments, images, config, **options):
    """The spec's options as the worker received them: they travel with the job, not with the policy's call."""
    return ToolOutput(text=json.dumps(options, sort_keys=True))
