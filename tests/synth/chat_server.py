"""A loopback OpenAI-compatible /v1/chat/completions server driven by a Python function."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


def message_text(content: str | list[dict]) -> str:
    """A message's text (the text parts of a multimodal content list)."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type") == "text")


class LoopbackChat:
    """``reply(prompt) -> (status, content)`` where ``prompt`` is the last message's text; every
    prompt is kept in ``prompts`` and every request body in ``bodies``."""

    def __init__(self, reply: Callable[[str], tuple[int, str]]) -> None:
        self.reply, self.prompts, self.bodies = reply, [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                outer.bodies.append(body)
                prompt = message_text(body["messages"][-1]["content"])
                outer.prompts.append(prompt)
                status, content = outer.reply(prompt)
                payload = json.dumps(
                    {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
