"""``ToolRegistry.targets``: what a pool preloads to serve a registry (each target once, in order)."""

from __future__ import annotations

from dataclasses import replace

from osvl.tools import ToolRegistry
from osvl.tools.profiles import tool_profile
from tests.tools.fault_tools import fault_specs


def test_each_target_once_in_registration_order():
    specs = fault_specs()
    twin = replace(specs[0], name="echo_twin")  # two tools served by one function
    targets = ToolRegistry([*specs, twin]).targets()
    assert len(targets) == len(set(targets)) and set(targets) == {s.target for s in specs}
    firsts = [s.target for i, s in enumerate(specs) if s.target not in {t.target for t in specs[:i]}]
    assert list(targets) == firsts


def test_every_profile_tool_is_listed():
    for name in ("paper", "release"):
        registry = tool_profile(name, python_interpreter=True).registry
        targets = registry.targets()
        assert {registry.get(n).target for n in registry.names} == set(targets)
        assert "osvl.tools.python_interpreter:python_interpreter_tool" in targets
