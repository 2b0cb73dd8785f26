"""The OpenAI-compatible ``/chat/completions`` client the LLM judges (``osvl.rl.judges``), the chat
expert and the synthesis pipeline's model calls share: bounded retries, and overload answers (429, 503)
waited out as back-pressure within ``ChatJudgeConfig.overload_wait_s``. It never raises for HTTP
trouble: a request that cannot be answered is a ``ChatOutcome`` with an error code, so a judge can say
"unscored" rather than guess.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from osvl.http_retry import retry_after_seconds


@dataclass(frozen=True)
class ChatJudgeConfig:
    """Where the judge model lives and how hard to try before declaring a sample unscored."""

    base_url: str  # e.g. "https://api.openai.com/v1" or "http://127.0.0.1:8000/v1"
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0  # per request
    max_attempts: int = 5
    backoff_initial_s: float = 1.0
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 30.0
    max_retry_after_s: float = 120.0  # cap on a server's Retry-After request
    overload_wait_s: float = 0.0  # 429/503 answers asked again this long without using attempts (0: they use them)
    temperature: float = 0.0
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge base_url must be an http(s) URL, got {self.base_url!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not (math.isfinite(self.overload_wait_s) and self.overload_wait_s >= 0):
            raise ValueError(f"overload_wait_s must be >= 0, got {self.overload_wait_s}")

    def backoff_s(self, retry_number: int) -> float:
        """Delay before retry ``retry_number`` (1-based): exponential, capped."""
        return min(self.backoff_initial_s * self.backoff_multiplier ** (retry_number - 1), self.backoff_max_s)


@dataclass(frozen=True)
class ChatOutcome:
    """The assistant message text, or None with an error code such as ``timeout``/``http_401``."""

    text: str | None
    error: str | None
    attempts: int  # HTTP requests made
    overloads: int = 0  # of them answered 429/503 and asked again as back-pressure


def _message_text(body: Any) -> str | None:
    """``choices[0].message.content`` of a chat-completions body, or None if malformed."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


class ChatCompletionsClient:
    """Blocking chat-completions client with bounded retries; safe to share across threads."""

    def __init__(
        self,
        config: ChatJudgeConfig,
        *,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = config
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(config.timeout_s), headers=headers, transport=transport)
        self._url = config.base_url.rstrip("/") + "/chat/completions"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ChatCompletionsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def complete(self, messages: list[dict[str, str]]) -> ChatOutcome:
        """Send one chat request, retrying transient failures; never raises for HTTP trouble.

        Retried: timeouts, connection errors, 408, 429 and 5xx (after the server's Retry-After
        when it sends one, else exponential backoff) and malformed bodies. Not retried: other 4xx
        (bad key, unknown model), which no wait will fix. Within ``overload_wait_s`` of the first
        request, 429 and 503 answers do not use up attempts.
        """
        cfg = self.config
        payload = {
            "model": cfg.model,
            "messages": messages,
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
        }
        error = "no_attempt"
        started = time.monotonic()
        requests = overloads = attempt = 0
        slept = 0.0  # so the overload window also holds when ``sleep`` does not take real time
        while attempt < cfg.max_attempts:
            requests += 1
            wait: float | None = None
            overloaded = False
            try:
                reply = self._http.post(self._url, json=payload)
            except httpx.TimeoutException:
                error = "timeout"
            except httpx.TransportError:
                error = "connection_error"
            except httpx.RequestError:  # undecodable body, redirect loop
                error = "request_error"
            else:
                status = reply.status_code
                if status == 200:
                    try:
                        text = _message_text(reply.json())
                    except ValueError:
                        text = None
                    if text is not None:
                        return ChatOutcome(text=text, error=None, attempts=requests, overloads=overloads)
                    error = "malformed_response"
                elif status in (408, 429) or status >= 500:
                    error = f"http_{status}"
                    overloaded = status in (429, 503) and cfg.overload_wait_s > 0
                    retry_after = retry_after_seconds(reply.headers.get("retry-after"))
                    if retry_after is not None:
                        wait = min(retry_after, cfg.max_retry_after_s)
                else:
                    return ChatOutcome(text=None, error=f"http_{status}", attempts=requests, overloads=overloads)
            if overloaded:
                overloads += 1
                pause = wait if wait is not None else cfg.backoff_s(overloads)
                if max(time.monotonic() - started, slept) + pause > cfg.overload_wait_s:
                    return ChatOutcome(None, f"overloaded_{error}", attempts=requests, overloads=overloads)
                self._sleep(pause)
                slept += pause
                continue
            attempt += 1
            if attempt < cfg.max_attempts:
                self._sleep(wait if wait is not None else cfg.backoff_s(attempt))
        return ChatOutcome(text=None, error=error, attempts=requests, overloads=overloads)
