"""ToolServerFleet against tool-server processes: calls spread over healthy servers, a server killed
(-9) mid-call turns that call into a typed infra error and later calls go to the survivor, a server
that comes back on its address rejoins, and with none left a call is an infra error naming them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import Job
from osvl.tools.fleet import ToolServerFleet

ROOT = Path(__file__).resolve().parents[2]


def _server(tmp_path: Path, name: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    ready = tmp_path / name
    ready.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.trainer.services", "tools", "--port", str(port), "--ready-file", str(ready)],
        cwd=ROOT,
        env=env,
    )
    deadline = time.monotonic() + 180
    while not ready.is_file():
        assert process.poll() is None and time.monotonic() < deadline, "tool server did not start"
        time.sleep(0.05)
    return process, ready.read_text()


def _echo(tag: str, seconds: float = 0.0) -> Job:
    return Job(
        tool="echo", target="tests.tools.fault_tools:echo", arguments={"tag": tag, "seconds": seconds}, deadline_s=30.0
    )


@pytest.fixture
def two_servers(tmp_path):
    a, url_a = _server(tmp_path, "a")
    b, url_b = _server(tmp_path, "b")
    yield tmp_path, (a, url_a), (b, url_b)
    for process in (a, b):
        process.kill()
        process.wait(30)


def test_failover_rejoin_and_no_server_left(two_servers):
    tmp_path, (a, url_a), (b, url_b) = two_servers
    fleet = ToolServerFleet((url_a, url_b), retry_after_s=0.2)
    try:
        results = [fleet.call(_echo(f"t{i}")) for i in range(4)]
        assert all(r.status is ToolStatus.OK for r in results)
        assert [m.calls for m in fleet.members] == [4, 0]  # idle servers: the first takes the calls in turn

        slow: dict = {}
        worker = threading.Thread(target=lambda: slow.update(result=fleet.call(_echo("slow", 5.0))))
        worker.start()
        time.sleep(1.0)  # the slow call is on server a
        os.kill(a.pid, signal.SIGKILL)
        worker.join(60)
        assert slow["result"].status is ToolStatus.INFRA_ERROR and "tool server" in slow["result"].error
        assert fleet.members[0].down_since is not None

        after = [fleet.call(_echo(f"u{i}")) for i in range(3)]
        assert all(r.status is ToolStatus.OK for r in after) and fleet.members[1].calls == 3

        port = int(url_a.rsplit(":", 1)[1])
        a, _ = _server(tmp_path, "a2", port)  # a comes back on its address
        time.sleep(0.3)
        back = fleet.call(_echo("back"))
        assert back.status is ToolStatus.OK and fleet.members[0].down_since is None and fleet.members[0].calls == 6

        for process in (a, b):
            process.kill()
            process.wait(30)
        first, second = fleet.call(_echo("gone")), fleet.call(_echo("gone"))  # each finds one server dead
        assert {first.error.split(": ")[0], second.error.split(": ")[0]} == {url_a, url_b}
        late = fleet.call(_echo("late"))
        assert late.status is ToolStatus.INFRA_ERROR and "no healthy tool server" in late.error
        assert url_a in late.error and url_b in late.error
        assert fleet.stats.submitted == fleet.stats.completed == 12
    finally:
        fleet.close()


def test_tool_names_and_bad_urls(two_servers):
    _, (_, url_a), _ = two_servers
    fleet = ToolServerFleet((url_a,))
    try:
        assert {"echo", "refuse"} <= fleet.tool_names(url_a)
        with pytest.raises(ValueError, match="127.0.0.1:9"):
            fleet.tool_names("http://127.0.0.1:9")
    finally:
        fleet.close()
    with pytest.raises(ValueError, match="at least one URL"):
        ToolServerFleet(())
