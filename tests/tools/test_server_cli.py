"""``python -m osvl.tools.server``: one node's tool server as a process, python_interpreter sandboxed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from osvl.rl.trajectory import ToolStatus
from osvl.tools import Job
from osvl.tools.client import RemoteToolPool
from osvl.tools.image_io import encode_png
from tests.tools.images import scene

REPO = Path(__file__).resolve().parents[2]


def test_the_server_process_serves_the_sandboxed_interpreter_and_stops_on_sigterm(tmp_path):
    world = tmp_path / "world"
    world.mkdir()
    (world / "corpus.jsonl").write_text(json.dumps({"id": "1", "title": "Page", "text": "Some text."}) + "\n")
    (world / "0.png").write_bytes(encode_png(scene(0, (40, 50))))
    (world / "images.jsonl").write_text(json.dumps({"image": "0.png", "title": "Entity"}) + "\n")
    ready = tmp_path / "url"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels")])}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "osvl.tools.server",
            "--world",
            str(world),
            "--port",
            "0",
            "--workers",
            "1",
            "--max-queue",
            "8",
            "--python-interpreter",
            "--ready-file",
            str(ready),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), server.stdout.read().decode()[-2000:] if server.poll() is not None else "no URL"
        url = ready.read_text()
        names = [s["function"]["name"] for s in httpx.get(f"{url}/v1/tools", timeout=30).json()]
        assert "python_interpreter" in names and "text_search" in names
        remote = RemoteToolPool(url)
        result = remote.call(
            Job("python_interpreter", "ignored:by_the_server", {"code": "print(6 * 7)"}, deadline_s=30.0)
        )
        assert result.status is ToolStatus.OK and result.text.strip() == "42", result.error
        assert result.worker.startswith(f"{url} pid ")
        hostile = remote.call(Job("python_interpreter", "x:y", {"code": "import socket\nsocket.socket()"}))
        assert hostile.status is ToolStatus.TOOL_ERROR and "socket" in hostile.error
        remote.close()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_running_the_server_module_warns_nothing():
    """osvl.tools does not import osvl.tools.server, so runpy does not find it imported before it runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels")])}
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "osvl.tools.server", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "usage: python -m osvl.tools.server" in done.stdout, done.stderr
    assert "RuntimeWarning" not in done.stderr
