"""LLM judges against a real OpenAI-compatible HTTP server on 127.0.0.1 (ephemeral port)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.rl.judges import LLMAccuracyJudge, LLMQueryJudge
from osvl.rl.offline_judges import HeuristicQueryJudge
from osvl.rl.rewards import score_batch

from .helpers import PROMPT, trajectory


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


def chat(content: str) -> Reply:
    body = {
        "id": "c1",
        "object": "chat.completion",
        "model": "judge",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
    }
    return Reply(body=json.dumps(body).encode())


def error(status: int, **headers: str) -> Reply:
    return Reply(status=status, body=json.dumps({"error": {"message": "nope"}}).encode(), headers=headers)


class ChatServer:
    """Answers POST /v1/chat/completions from a script (or a routing function) and logs requests."""

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.route: Callable[[dict], Reply] | None = None
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = {"path": self.path, "auth": self.headers.get("Authorization"), "body": json.loads(raw)}
                with server.lock:
                    server.requests.append(request)
                    if server.route is not None:
                        reply = server.route(request["body"])
                    elif server.script:
                        reply = server.script.pop(0)
                    else:
                        reply = chat("verdict: correct")
                time.sleep(reply.delay_s)
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply.body)))
                    for key, value in reply.headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(reply.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout); that is the point of the test

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.httpd.server_close()
            self.thread.join(timeout=5)


@pytest.fixture
def server():
    srv = ChatServer()
    yield srv
    srv.close()


class Sleeps(list):
    """Records requested backoff delays instead of sleeping, so retry tests take no time."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def make_client(server: ChatServer, sleeps: Sleeps, **overrides) -> ChatCompletionsClient:
    config = dict(
        base_url=server.base_url,
        model="judge-model",
        api_key="sk-test",
        timeout_s=2.0,
        max_attempts=4,
        backoff_initial_s=0.01,
        backoff_multiplier=2.0,
        backoff_max_s=0.05,
        max_retry_after_s=30.0,
    )
    config.update(overrides)
    return ChatCompletionsClient(ChatJudgeConfig(**config), sleep=sleeps)


def test_success_sends_openai_request(server) -> None:
    sleeps = Sleeps()
    server.script = [chat("The bridge is the same.\nverdict: correct")]
    with make_client(server, sleeps) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "It opened in 1982")
    assert verdict.score == 1.0 and verdict.attempts == 1 and verdict.scored
    assert verdict.judge == "chat:judge-model:accuracy_judge.v1"
    [request] = server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["auth"] == "Bearer sk-test"
    body = request["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    content = body["messages"][0]["content"]
    assert PROMPT.question in content and "- nineteen eighty-two" in content
    assert "It opened in 1982" in content and "$" not in content
    assert sleeps == []


def test_incorrect_verdict_scores_zero(server) -> None:
    server.script = [chat("verdict: correct?? no.\nVerdict: **Incorrect**")]
    with make_client(server, Sleeps()) as client:
        assert LLMAccuracyJudge(client).judge_answer(PROMPT, "1990").score == 0.0


def test_5xx_then_success_retries_with_exponential_backoff(server) -> None:
    sleeps = Sleeps()
    server.script = [error(503), error(500), error(502), chat("verdict: correct")]
    with make_client(server, sleeps) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score == 1.0 and verdict.attempts == 4
    assert len(server.requests) == 4
    assert sleeps == [0.01, 0.02, 0.04]


def test_backoff_is_capped(server) -> None:
    sleeps = Sleeps()
    server.script = [error(500)] * 6
    with make_client(server, sleeps, max_attempts=6) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert not verdict.scored and verdict.reason == "http_500" and verdict.attempts == 6
    assert sleeps == [0.01, 0.02, 0.04, 0.05, 0.05]


def test_429_honours_retry_after(server) -> None:
    sleeps = Sleeps()
    server.script = [error(429, **{"Retry-After": "7"}), error(429), chat("verdict: correct")]
    with make_client(server, sleeps) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score == 1.0 and verdict.attempts == 3
    assert sleeps == [7.0, 0.02]  # server's wait, then plain backoff when no header is sent


def test_503_retry_after_http_date_is_honoured(server) -> None:
    sleeps = Sleeps()
    server.script = [error(503, **{"Retry-After": "Thu, 01 Jan 1970 00:00:00 GMT"}), chat("verdict: correct")]
    with make_client(server, sleeps) as client:
        assert LLMAccuracyJudge(client).judge_answer(PROMPT, "1982").score == 1.0
    assert sleeps == [0.0]  # a date in the past means: retry now


def test_429_retry_after_is_capped(server) -> None:
    sleeps = Sleeps()
    server.script = [error(429, **{"Retry-After": "3600"}), chat("verdict: incorrect")]
    with make_client(server, sleeps, max_retry_after_s=1.5) as client:
        assert LLMAccuracyJudge(client).judge_answer(PROMPT, "1982").score == 0.0
    assert sleeps == [1.5]


def test_429_forever_is_unscored(server) -> None:
    sleeps = Sleeps()
    server.script = [error(429, **{"Retry-After": "0"})] * 4
    with make_client(server, sleeps) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score is None and verdict.reason == "http_429" and verdict.attempts == 4
    assert len(server.requests) == 4 and sleeps == [0.0, 0.0, 0.0]


def test_401_is_not_retried_and_unscored(server) -> None:
    sleeps = Sleeps()
    server.script = [error(401), chat("verdict: correct")]
    with make_client(server, sleeps) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score is None and verdict.reason == "http_401" and verdict.attempts == 1
    assert len(server.requests) == 1 and sleeps == []


def test_malformed_bodies_are_retried(server) -> None:
    sleeps = Sleeps()
    server.script = [
        Reply(body=b"{not json"),
        Reply(body=b'{"choices": []}'),
        Reply(body=b'{"choices": [{"message": {"content": null}}]}'),
        chat("verdict: correct"),
    ]
    with make_client(server, sleeps) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score == 1.0 and verdict.attempts == 4 and len(sleeps) == 3


def test_malformed_forever_is_unscored(server) -> None:
    server.script = [Reply(body=b"<html>gateway</html>")] * 4
    with make_client(server, Sleeps()) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score is None and verdict.reason == "malformed_response"
    assert len(server.requests) == 4


def test_slow_response_times_out_then_recovers(server) -> None:
    sleeps = Sleeps()
    # The prompt reply must beat the timeout even on a loaded CI machine, the slow one never.
    server.script = [Reply(body=chat("verdict: correct").body, delay_s=6.0), chat("verdict: correct")]
    with make_client(server, sleeps, timeout_s=1.5) as client:
        started = time.monotonic()
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
        elapsed = time.monotonic() - started
    assert verdict.score == 1.0 and verdict.attempts == 2 and sleeps == [0.01]
    assert elapsed < 5.0  # the client did not wait for the slow reply


def test_always_slow_is_unscored_timeout(server) -> None:
    server.script = [Reply(body=chat("verdict: correct").body, delay_s=0.6)] * 2
    with make_client(server, Sleeps(), timeout_s=0.15, max_attempts=2) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score is None and verdict.reason == "timeout" and verdict.attempts == 2


def test_connection_refused_is_unscored(server) -> None:
    base_url = server.base_url
    server.close()
    sleeps = Sleeps()
    config = ChatJudgeConfig(base_url=base_url, model="m", max_attempts=3, backoff_initial_s=0.01, timeout_s=1.0)
    with ChatCompletionsClient(config, sleep=sleeps) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score is None and verdict.reason == "connection_error" and verdict.attempts == 3
    assert len(sleeps) == 2


def test_unparsable_model_output_is_unscored(server) -> None:
    server.script = [chat("I think it is probably right.")]
    with make_client(server, Sleeps()) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score is None and verdict.reason == "unparsable_verdict"


def test_query_judge_scores_rubric(server) -> None:
    server.script = [chat('Good chain.\n{"relevance": 8, "progression": 6, "signal_to_noise": 10, "cross_modal": 0}')]
    traj = trajectory(["ok", "tool_error"])
    with make_client(server, Sleeps()) as client:
        verdict = LLMQueryJudge(client).judge_queries(PROMPT, traj.steps[:2])
    assert verdict.score == pytest.approx(0.6)
    content = server.requests[0]["body"]["messages"][0]["content"]
    assert '1. text_search {"query": "Kessock Bridge opening year"} -> ok: Kessock' in content
    assert "2. text_search" in content and "-> tool_error: tool_error happened" in content
    for dimension in ("relevance", "progression", "signal_to_noise", "cross_modal"):
        assert dimension in content


def test_query_judge_rejects_incomplete_rubric(server) -> None:
    server.script = [chat('{"relevance": 8, "progression": 6, "signal_to_noise": 11, "cross_modal": 1}')]
    with make_client(server, Sleeps()) as client:
        verdict = LLMQueryJudge(client).judge_queries(PROMPT, trajectory(["ok"]).steps)
    assert verdict.score is None and verdict.reason == "unparsable_verdict"


def test_batch_scoring_loses_nothing(server) -> None:
    """Mixed outages over a concurrent batch: every sample comes back, scored or marked unscored."""

    def route(body: dict) -> Reply:
        content = body["messages"][0]["content"]
        if "Tool calls (in order)" in content:
            return chat('{"relevance": 10, "progression": 10, "signal_to_noise": 10, "cross_modal": 10}')
        if "answer-401" in content:
            return error(401)
        if "answer-503" in content:
            return error(503)
        if "answer-slow" in content:
            return Reply(body=chat("verdict: correct").body, delay_s=5.0)
        return chat("verdict: correct" if "1982" in content.split("final answer:")[-1] else "verdict: incorrect")

    server.route = route
    answers = ["1982", "answer-401", "1990", "answer-503", "1982", "answer-slow", None, "1982"]
    batch = [trajectory(["ok"], answer=a, sample_index=i) for i, a in enumerate(answers)]
    sleeps = Sleeps()
    with make_client(server, sleeps, timeout_s=1.5, max_attempts=3) as client:  # prompt replies beat 1.5 s under load
        scored = score_batch(batch, LLMAccuracyJudge(client), LLMQueryJudge(client), max_workers=4)
    assert [t.sample_index for t in scored] == list(range(len(answers)))
    by_answer = dict(zip(map(str, answers), scored))
    assert by_answer["1982"].reward.acc == 1.0 and by_answer["1990"].reward.acc == 0.0
    assert by_answer["1982"].reward.total == pytest.approx(1.0)
    assert by_answer["None"].reward.acc == 0.0 and by_answer["None"].fatal_step == 1
    for bad, reason in (
        ("answer-401", "accuracy:http_401"),
        ("answer-503", "accuracy:http_503"),
        ("answer-slow", "accuracy:timeout"),
    ):
        assert by_answer[bad].reward.total is None
        assert by_answer[bad].reward.unscored_reason == reason
        assert by_answer[bad].reward.query == 1.0  # the other judge's verdict is kept
    assert sum(t.reward.scored for t in scored) == 5
    accuracy_requests = [
        r for r in server.requests if "Tool calls (in order)" not in r["body"]["messages"][0]["content"]
    ]
    # 3 good + 1 wrong + 401 once + 503 three times + slow three times; the fatal one asks nobody
    assert len(accuracy_requests) == 4 + 1 + 3 + 3
    assert len(server.requests) - len(accuracy_requests) == len(answers)


def test_offline_and_llm_judges_are_interchangeable(server) -> None:
    server.script = [chat("verdict: correct")]
    with make_client(server, Sleeps()) as client:
        [scored] = score_batch([trajectory(["ok"])], LLMAccuracyJudge(client), HeuristicQueryJudge())
    assert scored.reward.acc == 1.0 and 0.0 < scored.reward.query <= 1.0


def test_overload_answers_within_the_window_use_no_attempt(server) -> None:
    """429 and 503 are back-pressure: asked again after Retry-After (or backoff) while the window lasts,
    and the one attempt a verdict has goes to the answer that came after them."""
    sleeps = Sleeps()
    server.script = [error(503, **{"Retry-After": "2"}), error(429), error(503), chat("verdict: correct")]
    with make_client(server, sleeps, max_attempts=1, overload_wait_s=60.0) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score == 1.0 and verdict.attempts == 4 and verdict.overloads == 3
    assert sleeps == [2.0, 0.02, 0.04]  # Retry-After, then the backoff of the 2nd and 3rd overload answers


def test_overload_past_the_window_is_unscored_as_overload(server) -> None:
    sleeps = Sleeps()
    server.script = [error(429, **{"Retry-After": "1"})] * 10
    with make_client(server, sleeps, max_attempts=4, overload_wait_s=2.5) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.score is None and verdict.reason == "overloaded_http_429"
    assert verdict.attempts == 3 == verdict.overloads and sleeps == [1.0, 1.0]  # a third wait would pass 2.5 s


def test_other_server_errors_still_use_attempts_within_the_overload_window(server) -> None:
    sleeps = Sleeps()
    server.script = [error(500)] * 4
    with make_client(server, sleeps, max_attempts=2, overload_wait_s=60.0) as client:
        verdict = LLMAccuracyJudge(client).judge_answer(PROMPT, "1982")
    assert verdict.reason == "http_500" and verdict.attempts == 2 and verdict.overloads == 0
