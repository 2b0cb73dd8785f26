"""A service for the supervisor's tests, with the convention osvl's services follow:

    python -m tests.service_stub [--die-after S | --fail] --port P --ready-file F

It answers ``GET /`` with its pid once it listens and then writes its URL into F; ``--die-after``
makes it exit (status 3) that many seconds after it started serving, ``--fail`` before it serves.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


class _Pid(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = str(os.getpid()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--die-after", type=float, default=None)
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    if args.fail:
        return 2
    server = HTTPServer(("127.0.0.1", args.port), _Pid)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tmp = Path(args.ready_file).with_suffix(".tmp")
    tmp.write_text(f"http://127.0.0.1:{server.server_address[1]}")
    tmp.replace(args.ready_file)
    threading.Event().wait(args.die_after)
    return 3


if __name__ == "__main__":
    sys.exit(main())
