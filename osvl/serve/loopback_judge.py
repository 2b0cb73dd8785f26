"""A loopback OpenAI-compatible judge: the CPU form of the judge service (tests, ``tiny_grpo_services``).

It answers ``POST /v1/chat/completions`` for osvl's two judge prompts (``accuracy_judge.v1``,
``query_judge.v1``) with the offline judges' verdicts, so a run through it scores exactly like
``judges.accuracy = "exact"`` / ``judges.query = "heuristic"`` while exercising the HTTP path,
the verdict parsing, retries and outages. ``POST /admin/outage {"status": 503}`` makes every
chat request fail with that status until ``{"status": null}`` (with ``"match": TEXT``, only the
requests whose prompt contains TEXT): how tests take the judge down.

``python -m osvl.serve.loopback_judge --port P`` runs it as a process.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from osvl.rl.offline_judges import normalize_answer
from osvl.serve.stand_in import StandInServer, serve_until_interrupted, service_parser

_ACCURACY = re.compile(
    r"Question:\n(?P<question>.*?)\n\nReference answer \(any of these forms is acceptable\):\n"
    r"(?P<references>.*?)\n\nAssistant's final answer:\n(?P<response>.*?)\n\nDecide whether",
    re.DOTALL,
)
_QUERY = re.compile(r"Tool calls \(in order\):\n(?P<calls>.*?)\n\nScore each dimension", re.DOTALL)
_CALL = re.compile(r"^\d+\. (?P<action>.*?) -> (?P<outcome>\w+)", re.MULTILINE)


def verdict_text(prompt: str) -> str | None:
    """The judge model's reply to one of osvl's judge prompts; None for any other prompt."""
    if match := _ACCURACY.search(prompt):
        references = {normalize_answer(line.removeprefix("- ")) for line in match["references"].splitlines()} - {""}
        correct = normalize_answer(match["response"]) in references
        return f"Compared with the reference.\nverdict: {'correct' if correct else 'incorrect'}"
    if match := _QUERY.search(prompt):
        calls = _CALL.findall(match["calls"])
        ok = sum(outcome == "ok" for _, outcome in calls)
        actions = [action for action, _ in calls]
        signal = round(10 * ok / len(calls)) if calls else 0
        progression = round(10 * len(set(actions)) / len(actions)) if actions else 0
        scores = {
            "relevance": 5 if calls else 0,
            "progression": progression,
            "signal_to_noise": signal,
            "cross_modal": 5 if calls else 0,
        }
        return f"Reviewed {len(calls)} call(s).\n{json.dumps(scores)}"
    return None


class LoopbackJudgeServer(StandInServer):
    """``with LoopbackJudgeServer() as judge: judge.base_url`` (ends in ``/v1``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.outage: int | None = None  # HTTP status every chat request gets while set
        self.outage_match = ""  # ... only those whose prompt contains this text, when set
        self.requests = 0
        self._lock = threading.Lock()
        super().__init__(_handler(self), host, port, "osvl-loopback-judge")
        self.base_url = f"http://{host}:{self.httpd.server_address[1]}/v1"

    def chat(self, body: Any) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests += 1
            outage, match = self.outage, self.outage_match
        try:
            content = body["messages"][-1]["content"]
        except (KeyError, IndexError, TypeError):
            return 400, {"error": {"message": "messages[-1].content is required"}}
        text = content if isinstance(content, str) else "\n".join(p.get("text", "") for p in content)
        if outage is not None and match in text:
            return outage, {"error": {"message": "judge outage (loopback)"}}
        reply = verdict_text(text)
        if reply is None:
            return 400, {"error": {"message": "the loopback judge answers osvl's judge prompts only"}}
        return 200, {
            "id": "loopback",
            "object": "chat.completion",
            "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}],
        }


def _handler(server: LoopbackJudgeServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": "loopback-judge", "object": "model"}]})
            self._send(404, {"error": {"message": f"unknown path {self.path}"}})

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except ValueError:
                return self._send(400, {"error": {"message": "body is not JSON"}})
            if self.path == "/v1/chat/completions":
                return self._send(*server.chat(body))
            if self.path == "/admin/outage" and isinstance(body, dict):
                status = body.get("status")
                server.outage = None if status is None else int(status)
                server.outage_match = str(body.get("match") or "")
                return self._send(200, {"outage": server.outage, "match": server.outage_match})
            self._send(404, {"error": {"message": f"unknown path {self.path}"}})

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = service_parser(
        "python -m osvl.serve.loopback_judge", __doc__.splitlines()[0], 8000, "the base URL (ending in /v1)"
    )
    args = parser.parse_args(argv)
    server = LoopbackJudgeServer(args.host, args.port).start()
    return serve_until_interrupted(server, "loopback judge", server.base_url, args.ready_file)


if __name__ == "__main__":
    sys.exit(main())
