"""The CPU form of the service side, on this machine (``python -m osvl.serve --engine loopback --launch``):
osvl's SGLang-protocol loopback server over the checkpoint, a tool server over the offline world and,
when the recipe's judges are LLMs, the loopback judge, listening where the recipe's URLs point; and
the trainer's ``--set`` overrides for where they came up. :mod:`osvl.serve.supervisor` keeps them up.
"""

from __future__ import annotations

import json
import sys
from urllib.parse import urlsplit

from osvl.config import Recipe
from osvl.serve.commands import JUDGE_PORT, SGLANG_PORT, TOOL_PORT
from osvl.serve.supervisor import ServiceSpec


def _port(url: str, what: str) -> int:
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"{what} {url!r} names no port for the loopback service to listen on")
    return port


def loopback_services(recipe: Recipe, any_ports: bool = False) -> list[ServiceSpec]:
    """The CPU form's services, listening where the recipe's URLs point (``any_ports``: free ports):
    the SGLang-protocol server, the tool server and, for LLM judges, the loopback judge."""
    r, t = recipe.rollout, recipe.tools
    if not recipe.model.pretrained:
        raise ValueError("model.pretrained must name the HF checkpoint the loopback server serves")
    if not t.world_dir:
        raise ValueError("tools.world_dir must name the offline world the loopback tool server serves")
    llm = "llm" in (recipe.judges.accuracy, recipe.judges.query)
    ports = (
        [0] * 3
        if any_ports
        else [
            _port(r.sglang_urls[0], "rollout.sglang_urls[0]") if r.sglang_urls else SGLANG_PORT,
            _port(t.servers[0], "tools.servers[0]") if t.servers else TOOL_PORT,
            _port(recipe.judges.url, "judges.url") if llm and recipe.judges.url else JUDGE_PORT,
        ]
    )
    engine = (sys.executable, "-m", "osvl.serve.loopback_engine", "--model-path", recipe.model.pretrained)
    tools = (sys.executable, "-m", "osvl.tools.server", "--world", t.world_dir, "--workers", str(t.workers))
    specs = [
        ServiceSpec("SGLang loopback", (*engine, "--max-batch", str(r.max_in_flight)), ports[0]),
        ServiceSpec("tool server", tools, ports[1]),
    ]
    if llm:
        specs.append(ServiceSpec("loopback judge", (sys.executable, "-m", "osvl.serve.loopback_judge"), ports[2]))
    return specs


def loopback_overrides(recipe: Recipe, urls: list[str]) -> list[str]:
    """The trainer's ``--set`` overrides for the URLs the loopback services came up on."""
    overrides = [f"rollout.sglang_urls={json.dumps([urls[0]])}", f"tools.servers={json.dumps([urls[1]])}"]
    if "llm" in (recipe.judges.accuracy, recipe.judges.query):
        overrides.append(f"judges.url={urls[2]}")
    return overrides
