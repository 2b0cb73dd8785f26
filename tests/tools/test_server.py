import base64
import json

import httpx
import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import ToolEnvironment, VisualContext
from osvl.tools.image_io import encode_png
from osvl.tools.pool import Job
from osvl.tools.server import RemoteToolPool, ToolServer


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
