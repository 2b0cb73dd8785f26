"""Programmable HTTP servers on 127.0.0.1 for testing the online tool backends for real."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    body: bytes | str | Any = b""
    headers: dict[str, str] | None = None
    delay_s: float = 0.0


Handler = Callable[[Request], Reply]


class LoopbackServer:
    """Routes by path prefix; a route is a handler, or a list of replies/handlers served in turn."""

    def __init__(self) -> None:
        self.routes: dict[str, Handler | list[Reply | Handler]] = {}
        self.requests: list[Request] = []
        server = self

        class _Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                request = Request(
                    self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, self.rfile.read(length)
                )
                server.requests.append(request)
                reply = server._reply(request)
                if reply.delay_s:
                    threading.Event().wait(reply.delay_s)
                body = reply.body
                if not isinstance(body, (bytes, str)):
                    body = json.dumps(body)
                body = body.encode() if isinstance(body, str) else body
                try:
                    self.send_response(reply.status)
                    for key, value in (reply.headers or {}).items():
                        self.send_header(key, value)
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_POST = _serve

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def _reply(self, request: Request) -> Reply:
        for prefix in sorted(self.routes, key=len, reverse=True):
            if request.path.startswith(prefix):
                route = self.routes[prefix]
                if not callable(route):
                    route = route.pop(0) if len(route) > 1 else route[0]  # the last reply repeats
                return route(request) if callable(route) else route
        return Reply(404, "no route")

    def hits(self, prefix: str) -> list[Request]:
        return [r for r in self.requests if r.path.startswith(prefix)]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
