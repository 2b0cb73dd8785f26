"""One spawned tool pool (the fault tools of the tools tests) and one tiny engine per session."""

from __future__ import annotations

import pytest

from osvl.data.chat import ChatRenderer
from osvl.rollout.local_engine import LocalEngine
from osvl.tools import PoolConfig, ToolBackendsConfig, ToolEnvironment, ToolPool, ToolRegistry
from tests.rollout.helpers import IMAGE_CONFIG, tiny_model, tokenizer
from tests.tools.fault_tools import fault_specs


@pytest.fixture(scope="session")
def registry():
    return ToolRegistry(fault_specs())


@pytest.fixture(scope="session")
def tool_pool(registry):
    """Workers that import the fault tools before they are ready, as the stages' pools do."""
    config = PoolConfig(num_workers=2, max_queue=16, watch_interval_s=0.02, preload=registry.targets())
    with ToolPool(ToolBackendsConfig(), config) as pool:
        yield pool


@pytest.fixture(scope="session")
def env(registry, tool_pool):
    return ToolEnvironment(registry, tool_pool)


@pytest.fixture(scope="session")
def renderer(env):
    # two schemas keep the tiny-BPE prompt short; every fault tool stays callable
    shown = [env.registry.get(name).openai_schema() for name in ("echo", "echo_image")]
    return ChatRenderer(tokenizer(), IMAGE_CONFIG, shown)


@pytest.fixture(scope="session")
def local_engine():
    return LocalEngine(tiny_model(), tokenizer(), IMAGE_CONFIG, max_batch=8)
