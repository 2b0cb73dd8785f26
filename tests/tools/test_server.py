import base64
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import PoolConfig, ToolBackendsConfig, ToolEnvironment, ToolPool, ToolRegistry, VisualContext
from osvl.tools.client import RemoteToolPool
from osvl.tools.fleet import ToolServerFleet
from osvl.tools.image_io import encode_png
from osvl.tools.pool import Job
from osvl.tools.server import ToolServer
from osvl.tools.wire import INSTANCE_HEADER
from tests.tools.fault_tools import fault_specs
from tests.trainer.gate_tool import GATE_ENV, gate_spec


@pytest.fixture(scope="module")
def server(fault_pool, fault_registry):
    server = ToolServer(fault_registry, fault_pool, max_request_bytes=1 << 20).start()
    yield server
    server.close()


@pytest.fixture()
def remote(server):
    pool = RemoteToolPool(server.url)
    yield pool
    pool.close()


def test_environment_runs_unchanged_against_a_remote_pool(server, remote, fault_registry):
    env = ToolEnvironment(fault_registry, remote)
    context = VisualContext([np.full((5, 6, 3), 40, np.uint8)])
    result = env.execute_sync({"name": "echo_image", "arguments": {"image": 0, "tag": "r"}}, context)
    assert result.status is ToolStatus.OK, result.error
    assert result.text.startswith("echo:r:") and np.all(context.resolve(1) == 41)
    timeout = env.execute_sync({"name": "hang", "arguments": {}}, context, deadline_s=0.3)
    assert timeout.status is ToolStatus.TIMEOUT
    assert remote.stats.submitted == 2 == remote.stats.completed
    assert [s["function"]["name"] for s in remote.tool_schemas()] == fault_registry.names
    stats = httpx.get(f"{server.url}/v1/stats").json()
    assert stats["timeouts"] >= 1


def test_server_revalidates_and_never_runs_client_named_code(server):
    def post(body):
        return httpx.post(f"{server.url}/v1/call", json=body)

    reply = post({"tool": "nope", "arguments": {}, "images": []})
    assert reply.status_code == 200 and reply.json()["status"] == "parse_error"
    reply = post({"tool": "echo", "arguments": {"seconds": -5}, "images": []})
    assert reply.json()["status"] == "invalid_arguments" and "must be >= 0" in reply.json()["error"]
    reply = post({"tool": "echo", "arguments": {}, "target": "os:system", "images": []})
    assert reply.json()["status"] == "ok"  # unknown body fields are ignored, the registry decides what runs
    assert post({"tool": "echo_image", "arguments": {"image": 0}, "images": []}).status_code == 400
    assert post({"tool": "echo", "images": ["%%%"]}).status_code == 400
    assert post({"tool": "echo", "deadline_s": "soon"}).status_code == 400
    assert post(["echo"]).status_code == 400
    assert httpx.post(f"{server.url}/v1/call", content=b"{not json").status_code == 400
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404


def test_server_refuses_decompression_bombs_and_huge_requests(server):
    bomb = base64.b64encode(encode_png(np.zeros((6000, 5000, 3), np.uint8))).decode()  # 30 Mpx > 24 Mpx limit
    reply = httpx.post(
        f"{server.url}/v1/call", json={"tool": "echo_image", "arguments": {"image": 0}, "images": [bomb]}
    )
    assert reply.status_code == 400 and "over the limit" in reply.json()["error"]
    big = json.dumps({"tool": "echo", "arguments": {"tag": "x" * (2 << 20)}})
    assert httpx.post(f"{server.url}/v1/call", content=big).status_code == 413


def test_unreachable_server_is_an_infra_error():
    pool = RemoteToolPool("http://127.0.0.1:9", grace_s=1.0)
    result = pool.call(Job("echo", "unused:unused", {}, [], deadline_s=1.0))
    assert result.status is ToolStatus.INFRA_ERROR and "tool server failed" in result.error
    pool.close()


@pytest.fixture(scope="module")
def narrow_server(fault_registry, tmp_path_factory):
    """One worker and room for one queued call, and the gate tool: two gate calls overload it until
    the gate file exists."""
    gate = tmp_path_factory.mktemp("gate") / "open"
    previous = os.environ.get(GATE_ENV)
    os.environ[GATE_ENV] = str(gate)  # the pool's workers inherit it
    registry = ToolRegistry([*fault_specs(), gate_spec()])
    config = PoolConfig(num_workers=1, max_queue=1, watch_interval_s=0.02, preload=registry.targets())
    try:
        with ToolPool(ToolBackendsConfig(), config) as pool:
            server = ToolServer(registry, pool).start()
            yield server, gate
            server.close()
    finally:
        if previous is None:
            os.environ.pop(GATE_ENV)
        else:
            os.environ[GATE_ENV] = previous


def _echo(tag: str, seconds: float = 0.0, end_to_end_s: float | None = None) -> Job:
    arguments = {"tag": tag, "seconds": seconds}
    return Job("echo", "tests.tools.fault_tools:echo", arguments, deadline_s=10.0, end_to_end_s=end_to_end_s)


@contextmanager
def _overloaded(narrow_server):
    """The worker held by a gate call and the queue by another, until the block ends and the gate opens."""
    server, gate = narrow_server
    gate.unlink(missing_ok=True)
    taken = server.pool.stats.submitted
    client = RemoteToolPool(server.url)
    held = Job("gate", "tests.trainer.gate_tool:gate", {"tag": "held"}, deadline_s=120.0)
    with ThreadPoolExecutor(2) as callers:
        running = [callers.submit(client.call, held) for _ in range(2)]  # the second may meet the first queued
        try:
            deadline = time.monotonic() + 60
            while server.pool.stats.submitted < taken + 2:
                assert time.monotonic() < deadline, "the gate calls were not admitted"
                time.sleep(0.01)
            yield server
        finally:
            gate.touch()
        assert [r.result().status for r in running] == [ToolStatus.OK] * 2
    client.close()


def test_a_full_queue_answers_a_typed_overload_with_when_to_ask_again(narrow_server):
    with _overloaded(narrow_server) as server:
        reply = httpx.post(f"{server.url}/v1/call", json={"tool": "echo", "arguments": {"tag": "x"}})
        assert reply.status_code == 503 and reply.json()["kind"] == "overloaded"
        assert int(reply.headers["retry-after"]) >= 1 and reply.json()["retry_after_s"] > 0
        assert reply.headers[INSTANCE_HEADER] == server.instance


def test_overload_is_waited_out_and_every_call_runs_once(narrow_server):
    """Eight callers at a server whose queue is full: every call is answered ok once it has room, none is
    lost or run twice, and the results say how many overload answers their call waited out."""
    client = RemoteToolPool(narrow_server[0].url)
    before = narrow_server[0].pool.stats.completed
    with ThreadPoolExecutor(8) as callers:
        with _overloaded(narrow_server):
            calls = [callers.submit(client.call, _echo(f"c{i}", 0.05)) for i in range(8)]
            time.sleep(1.0)
        results = [c.result() for c in calls]
    assert [r.status for r in results] == [ToolStatus.OK] * 8, [r.error for r in results]
    assert [r.text.split(":")[1] for r in results] == [f"c{i}" for i in range(8)]
    assert sum(r.overloads for r in results) > 0 and not any(r.overloaded for r in results)
    assert narrow_server[0].pool.stats.completed - before == 8 + 2  # and the two gate calls
    client.close()


def test_a_call_whose_deadline_passes_while_overloaded_is_an_overload_infra_error(narrow_server):
    with _overloaded(narrow_server) as server:
        client = RemoteToolPool(server.url)
        late = client.call(_echo("late", end_to_end_s=0.5))
        client.close()
    assert late.status is ToolStatus.INFRA_ERROR and late.overloaded and late.overloads >= 1
    assert late.worker == "" and "overloaded" in late.error


def test_the_fleet_takes_an_overloaded_servers_call_to_another(narrow_server, server):
    fleet = ToolServerFleet((narrow_server[0].url, server.url))
    with _overloaded(narrow_server):
        result = fleet.call(_echo("elsewhere"))
    fleet.close()
    assert result.status is ToolStatus.OK and result.overloads == 1
    assert result.worker.startswith(server.url)


def test_a_restarted_server_is_seen_as_a_new_instance(fault_pool, fault_registry):
    first = ToolServer(fault_registry, fault_pool).start()
    port = int(first.url.rsplit(":", 1)[1])
    client = RemoteToolPool(first.url)
    fleet = ToolServerFleet((first.url,))
    assert client.call(_echo("a")).status is ToolStatus.OK and fleet.call(_echo("a")).status is ToolStatus.OK
    first.close()
    second = ToolServer(fault_registry, fault_pool, port=port).start()
    try:
        assert client.call(_echo("b")).status is ToolStatus.OK and client.restarts == 1
        assert fleet.call(_echo("b")).status is ToolStatus.OK
        assert fleet.take_restarts() == 1 and fleet.take_restarts() == 0
    finally:
        second.close()
        client.close()
        fleet.close()
