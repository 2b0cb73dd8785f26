"""Deterministic tools for the GRPO resume test, importable by spawned tool workers.

``tests.tools.fault_tools.echo`` stamps the worker's pid into its output, which makes two runs'
observations (and so their logprobs) differ by design; resumption needs outputs that depend only on
the call.
"""

from __future__ import annotations

from contextlib import contextmanager

from osvl.tools import PoolConfig, ToolEnvironment, ToolPool, ToolRegistry, ToolsConfig
from osvl.tools.registry import ToolOutput, ToolSpec
from osvl.trainer.tool_env import with_faults
from tests.tools.fault_tools import fault_specs


def echo(arguments, images, config):
    return ToolOutput(text=f"echo:{arguments.get('tag', '')}")


def deterministic_specs() -> list[ToolSpec]:
    specs = {s.name: s for s in fault_specs()}
    specs["echo"] = ToolSpec(name="echo", description="echo the tag", parameters=specs["echo"].parameters,
                             target="tests.trainer.resume_fixtures:echo")
    return list(specs.values())


@contextmanager
def deterministic_environment(recipe, rank):
    """One tool worker: results come back in submission order, so fault draws follow it too."""
    with ToolPool(ToolsConfig(), PoolConfig(num_workers=1, max_queue=16, watch_interval_s=0.02)) as pool:
        yield with_faults(ToolEnvironment(ToolRegistry(deterministic_specs()), pool), recipe, rank)
