"""``osvl.serve.supervisor``: a killed service comes back on its port while the others keep running; a
service that keeps dying stops them all; one that cannot start stops the launch."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from osvl.serve.supervisor import RestartPolicy, ServiceSpec, Supervisor
from tests.tools.proctree import wait_for

ROOT = Path(__file__).resolve().parents[2]
FAST = RestartPolicy(max_restarts=2, window_s=60.0, first_delay_s=0.05, ready_timeout_s=120.0)


def _stub(name: str, *flags: str) -> ServiceSpec:
    return ServiceSpec(name, (sys.executable, "-m", "tests.service_stub", *flags))


def _pid(url: str) -> int | None:
    try:
        return int(httpx.get(url, timeout=5).text)
    except httpx.HTTPError:
        return None


@pytest.fixture(autouse=True)
def _importable_stub(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(ROOT)


def _supervise(supervisor: Supervisor) -> tuple[threading.Event, dict, threading.Thread]:
    stop, outcome = threading.Event(), {}
    thread = threading.Thread(target=lambda: outcome.update(code=supervisor.run(stop, poll_s=0.05)))
    thread.start()
    return stop, outcome, thread


def test_a_killed_service_comes_back_on_its_port_and_the_others_stay_up(tmp_path):
    lines: list[str] = []
    supervisor = Supervisor([_stub("a"), _stub("b")], tmp_path, FAST, log=lines.append)
    url_a, url_b = supervisor.start()
    pid_a, pid_b = _pid(url_a), _pid(url_b)
    stop, outcome, thread = _supervise(supervisor)
    try:
        os.kill(pid_a, signal.SIGKILL)
        deadline = time.monotonic() + 120
        assert wait_for(lambda: _pid(url_a) not in (None, pid_a), deadline - time.monotonic()), lines
        assert _pid(url_b) == pid_b  # never touched
        death = f"a (pid {pid_a}) ended with signal SIGKILL while serving; restart 1 of at most 2"
        assert any(death in x for x in lines), lines
        # the supervisor says so at its next poll after the new process answers, which may come after ours
        assert wait_for(lambda: f"a is back at {url_a}" in lines, deadline - time.monotonic()), lines
    finally:
        stop.set()
        thread.join(60)
    assert outcome["code"] == 0
    assert _pid(url_a) is None and _pid(url_b) is None  # stopped when asked


def test_a_service_that_keeps_dying_stops_every_service(tmp_path):
    lines: list[str] = []
    supervisor = Supervisor([_stub("steady"), _stub("flaky", "--die-after", "0.2")], tmp_path, FAST, log=lines.append)
    steady, _ = supervisor.start()
    stop, outcome, thread = _supervise(supervisor)
    thread.join(120)
    assert outcome["code"] == 1
    assert sum("flaky" in x and "ended with exit status 3" in x for x in lines) == 3, lines
    assert "it keeps dying; stopping every service" in lines[-1]
    assert _pid(steady) is None


def test_a_service_that_cannot_start_stops_the_launch(tmp_path):
    supervisor = Supervisor([_stub("first"), _stub("broken", "--fail")], tmp_path, FAST)
    with pytest.raises(RuntimeError, match="broken ended with exit status 2 before serving"):
        supervisor.start()
    assert all(s.process is None or s.process.poll() is not None for s in supervisor.services)
