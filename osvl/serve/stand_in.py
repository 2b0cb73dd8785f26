"""What osvl's stand-in services (the SGLang-protocol engine, ``loopback_engine``, and the judge,
``loopback_judge``) share: an HTTP server on a daemon thread, and the process's side of the supervisor's
contract (``--host``, ``--port``, ``--ready-file``: the URL written there once it serves)."""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self


class _Server(ThreadingHTTPServer):
    """A listen backlog for many concurrent clients (the stdlib's 5 refuses connections under load)."""

    request_queue_size = 1024
    daemon_threads = True


class StandInServer:
    """One thread per connection on a daemon thread: ``start``/``close``, or ``with server: ...``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], host: str, port: int, thread_name: str) -> None:
        self.httpd = _Server((host, port), handler)
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name=thread_name)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Self:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def service_parser(prog: str, description: str, default_port: int, url: str) -> argparse.ArgumentParser:
    """The command line the supervisor starts a stand-in with; ``url`` says what the ready file holds."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=default_port, help="0 = any free port (printed, and in --ready-file)"
    )
    parser.add_argument("--ready-file", default="", help=f"write {url} here once it serves")
    return parser


def serve_until_interrupted(server: StandInServer, name: str, url: str, ready_file: str) -> int:
    """Announces the started ``server``, writes ``url`` to ``ready_file`` (whole, by a rename: the supervisor
    never reads half a URL) and serves until interrupted."""
    print(f"osvl {name} on {url}", flush=True)
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(url)
        tmp.replace(ready_file)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.close()
    return 0
