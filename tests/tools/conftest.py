"""Shared, spawned-once tool pools: worker start-up is the slow part of these tests."""

from __future__ import annotations

import pytest

from osvl.tools import PoolConfig, ToolBackendsConfig, ToolEnvironment, ToolPool, ToolRegistry
from tests.tools.fault_tools import fault_specs

LEAK_LIMIT_BYTES = 400 << 20


@pytest.fixture(scope="session")
def fault_pool():
    config = PoolConfig(num_workers=2, max_queue=4, max_rss_bytes=LEAK_LIMIT_BYTES, watch_interval_s=0.02)
    with ToolPool(ToolBackendsConfig(), config) as pool:
        yield pool


@pytest.fixture(scope="session")
def fault_registry():
    return ToolRegistry(fault_specs())


@pytest.fixture()
def fault_env(fault_pool, fault_registry):
    return ToolEnvironment(fault_registry, fault_pool)
