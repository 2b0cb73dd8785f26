"""The equivalence judge against a loopback OpenAI-compatible server, failures included."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from osvl.eval.items import EvalItem
from osvl.eval.judge import EquivalenceJudge, NormalizedMatchJudge, load_prompt
from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig

ITEM = EvalItem("fvqa", "1", "Which city is shown?", ("Oslo", "Christiania"))


class LoopbackChat:
    """POST /v1/chat/completions answered by ``route(request) -> (status, body bytes, delay_s)``."""

    def __init__(self, route) -> None:
        self.route, self.requests = route, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(body)
                status, payload, delay = owner.route(body)
                time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chat(content: str) -> tuple[int, bytes, float]:
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode(), 0.0


def judge_for(server: LoopbackChat, attempts: int = 2, timeout_s: float = 2.0) -> EquivalenceJudge:
    config = ChatJudgeConfig(
        base_url=server.url, model="gpt-4o", max_attempts=attempts, timeout_s=timeout_s, backoff_initial_s=0.0
    )
    return EquivalenceJudge(ChatCompletionsClient(config, sleep=lambda s: None))


@pytest.fixture
def serve():
    servers = []

    def start(route):
        servers.append(LoopbackChat(route))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_verdicts_and_the_prompt_that_was_sent(serve):
    server = serve(
        lambda body: (
            chat("Same city under its old name.\nverdict: correct")
            if "Kristiania" in body["messages"][0]["content"]
            else chat("verdict: incorrect")
        )
    )
    judge = judge_for(server)
    good, bad = judge.judge(ITEM, "Kristiania (old name)"), judge.judge(ITEM, "Bergen")
    assert (good.score, bad.score) == (1.0, 0.0) and good.attempts == 1
    assert judge.name == "chat:gpt-4o:equivalence_judge.v1"
    sent = server.requests[0]["messages"][0]["content"]
    assert "Which city is shown?" in sent and "- Oslo\n- Christiania" in sent and sent.rstrip().endswith("incorrect")
    assert server.requests[0]["model"] == "gpt-4o" and server.requests[0]["temperature"] == 0.0


def test_missing_answer_is_wrong_without_a_request(serve):
    server = serve(lambda body: chat("verdict: correct"))
    verdict = judge_for(server).judge(ITEM, "  ")
    assert verdict.score == 0.0 and verdict.reason == "no_answer" and server.requests == []


@pytest.mark.parametrize(
    "route, reason",
    [
        (lambda body: (503, b'{"error": "overloaded"}', 0.0), "http_503"),
        (lambda body: (200, b'{"choices": []}', 0.0), "malformed_response"),
        (lambda body: (200, b"<html>not json", 0.0), "malformed_response"),
        (lambda body: chat("I am not sure."), "unparsable_verdict"),
        (lambda body: (401, b'{"error": "bad key"}', 0.0), "http_401"),
        (lambda body: chat("verdict: correct")[:2] + (1.0,), "timeout"),
    ],
)
def test_outages_are_unscored_never_wrong(serve, route, reason):
    # A short client timeout only where the timeout is the point: elsewhere a loaded CI machine
    # can take longer than 0.3 s to answer, and the verdict would read "timeout" instead.
    timeout_s = 0.3 if reason == "timeout" else 30.0
    verdict = judge_for(serve(route), attempts=2, timeout_s=timeout_s).judge(ITEM, "Oslo")
    assert verdict.score is None and not verdict.scored and verdict.reason == reason


def test_retry_recovers_from_a_transient_5xx(serve):
    replies = iter([(500, b"{}", 0.0), chat("verdict: correct")])
    verdict = judge_for(serve(lambda body: next(replies)), attempts=3).judge(ITEM, "Oslo")
    assert verdict.score == 1.0 and verdict.attempts == 2


def test_offline_normalized_match():
    judge = NormalizedMatchJudge()
    assert judge.judge(ITEM, "  the OSLO. ").score == 1.0
    assert judge.judge(ITEM, "christiania").score == 1.0
    assert judge.judge(ITEM, "Oslo, Norway").score == 0.0
    assert judge.judge(ITEM, None).reason == "no_answer"


def test_prompt_files_are_versioned_and_unknown_ones_fail():
    assert set(load_prompt("equivalence_judge.v1.txt").get_identifiers()) == {"question", "references", "response"}
    with pytest.raises(ValueError, match="no judge prompt 'equivalence_judge.v9.txt'"):
        load_prompt("equivalence_judge.v9.txt")
