"""Deterministic tools for the GRPO resume test, importable by spawned tool workers.

``tests.tools.fault_tools.echo`` stamps the worker's pid into its output, which makes two runs'
observations (and so their logprobs) differ by design; resumption needs outputs that depend only on
the call.

A worker imports this module (the pool preloads it at start-up), so it imports nothing the worker
does not already hold (no torch, no trainer). When it imported ``osvl.trainer`` and workers still
imported on first call, a run's first echo took ~10 s on an idle machine and over 30 s (the default
deadline) on a loaded one: it timed out, and the two runs diverged at step 1.
"""

from __future__ import annotations

from dataclasses import replace

from osvl.tools.registry import ToolOutput, ToolSpec
from tests.tools.fault_tools import fault_specs

# A call that hits its deadline is rolled out differently (a timeout observation, no fault draw),
# so no CPU load may reach it: the scripted calls return at once.
DEADLINE_S = 600.0
SCRIPTED_TOOLS = ("echo", "refuse")  # what grpo_fixtures.scripted calls


def echo(arguments, images, config):
    return ToolOutput(text=f"echo:{arguments.get('tag', '')}")


def deterministic_specs() -> list[ToolSpec]:
    specs = {s.name: replace(s, deadline_s=DEADLINE_S) for s in fault_specs() if s.name in SCRIPTED_TOOLS}
    specs["echo"] = replace(specs["echo"], description="echo the tag", target="tests.trainer.resume_fixtures:echo")
    return list(specs.values())
