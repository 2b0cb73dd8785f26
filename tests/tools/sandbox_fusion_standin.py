"""A loopback stand-in that speaks SandboxFusion's ``POST /run_code`` (request and response shapes of
bytedance/SandboxFusion's sandbox API). It runs the code in a plain child process: it is a protocol
double for the client, not a sandbox. ``mode`` makes it misbehave the ways a real service can."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FusionStandIn:
    def __init__(self) -> None:
        self.mode = "normal"  # normal | sandbox_error | http_500 | garbage | no_status | slow
        self.requests: list[dict[str, Any]] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def answer(self, request: dict[str, Any]) -> tuple[int, bytes]:
        self.requests.append(request)
        if self.mode == "http_500":
            return 500, b"internal error"
        if self.mode == "garbage":
            return 200, b"<html>not json</html>"
        if self.mode == "no_status":
            return 200, json.dumps({"run_result": None}).encode()
        if self.mode == "sandbox_error":
            return 200, json.dumps(
                {
                    "status": "SandboxError",
                    "message": "executor pod lost",
                    "compile_result": None,
                    "run_result": None,
                    "files": {},
                }
            ).encode()
        if self.mode == "slow":
            time.sleep(float(request["run_timeout"]) + 5)
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", request["code"]],
                capture_output=True,
                text=True,
                timeout=float(request["run_timeout"]),
            )
            run = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
        except subprocess.TimeoutExpired as err:
            run = {
                "status": "TimeLimitExceeded",
                "return_code": None,
                "stdout": str(err.stdout or ""),
                "stderr": str(err.stderr or ""),
            }
        run["execution_time"] = time.monotonic() - started
        status = "Success" if run["return_code"] == 0 else "Failed"
        return 200, json.dumps(
            {
                "status": status,
                "message": "",
                "compile_result": None,
                "run_result": run,
                "executor_pod_name": None,
                "files": {},
            }
        ).encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                status, payload = (404, b"") if self.path != "/run_code" else standin.answer(body)
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (the "slow" mode)

        return Handler
