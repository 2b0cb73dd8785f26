"""A tool that holds its call until a file exists: the forced slow trajectory of the asynchronous GRPO
tests. Tool workers import this module at start-up, so it imports nothing heavy (no torch)."""

from __future__ import annotations

import os
import time

from osvl.tools.registry import ToolOutput, ToolSpec

GATE_ENV = "OSVL_TEST_GATE"  # the file whose existence opens the gate
MAX_WAIT_S = 600.0


def gate(arguments, images, config):
    path, deadline = os.environ[GATE_ENV], time.monotonic() + MAX_WAIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return ToolOutput(text=f"gate:{arguments.get('tag', '')}:{'open' if os.path.exists(path) else 'timed out'}")


def gate_spec() -> ToolSpec:
    return ToolSpec(
        name="gate",
        description="echo the tag once the gate opens",
        parameters={"type": "object", "properties": {"tag": {"type": "string", "maxLength": 64}}},
        target="tests.trainer.gate_tool:gate",
        deadline_s=MAX_WAIT_S + 60,
    )
