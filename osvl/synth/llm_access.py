"""Metered access to the curation LLM: one call budget across stages, a disk cache, outages as stops.

Every LLM-backed stage (rewriting, uniqueness, the closed-book filter, the expert) talks to the
endpoint through a :class:`MeteredChat` sharing one :class:`LLMUsage`. A request the endpoint
cannot serve right now (timeout, connection refused, 429/5xx after the client's retries, a bad
key, an exhausted budget) raises :class:`LLMUnavailable` instead of returning an empty reply:
an empty reply would read as "no descriptor" or "no answer" and silently drop the item, while a
raise stops the stage before the item is decided, so a rerun resumes it. Only replies the
request itself caused (400/413/422) come back as ordinary failed outcomes.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osvl.jsonl import iter_jsonl
from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig, ChatOutcome

REQUEST_ERRORS = frozenset({"http_400", "http_413", "http_422"})  # this request is bad; others would fare alike


class LLMUnavailable(RuntimeError):
    """The endpoint cannot answer now (outage, bad credentials, budget): stop and resume later."""


@dataclass
class LLMUsage:
    """Calls, cache hits and outages per stage, under one budget (``None``: unlimited)."""

    max_calls: int | None = None
    calls: Counter[str] = field(default_factory=Counter)
    cache_hits: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.max_calls is not None and self.max_calls < 0:
            raise ValueError(f"max LLM calls must be >= 0, got {self.max_calls}")

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_calls": self.max_calls,
            "calls": dict(sorted(self.calls.items())),
            "cache_hits": dict(sorted(self.cache_hits.items())),
            "failures": dict(sorted(self.failures.items())),
        }


def request_key(config: ChatJudgeConfig, messages: list[dict[str, Any]]) -> str:
    body = json.dumps(
        [config.base_url, config.model, config.temperature, config.max_tokens, messages],
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


@dataclass
class MeteredChat:
    """A :class:`ChatCompletionsClient` for one stage; replies are cached in ``cache_path`` (JSONL)
    when given (deterministic stages only: expert rollouts must differ, so they go uncached)."""

    client: ChatCompletionsClient
    stage: str
    usage: LLMUsage
    cache_path: Path | None = None
    _cache: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.cache_path is not None and self.cache_path.exists():
            for _, row in iter_jsonl(self.cache_path):
                self._cache[row["key"]] = row["text"]

    @property
    def config(self) -> ChatJudgeConfig:
        return self.client.config

    def complete(self, messages: list[dict[str, Any]]) -> ChatOutcome:
        key = request_key(self.config, messages) if self.cache_path is not None else None
        if key is not None and key in self._cache:
            self.usage.cache_hits[self.stage] += 1
            return ChatOutcome(text=self._cache[key], error=None, attempts=0)
        if self.usage.max_calls is not None and self.usage.total_calls >= self.usage.max_calls:
            raise LLMUnavailable(f"LLM budget of {self.usage.max_calls} calls is spent (stage {self.stage})")
        self.usage.calls[self.stage] += 1
        outcome = self.client.complete(messages)
        if outcome.text is None:
            self.usage.failures[self.stage] += 1
            if outcome.error not in REQUEST_ERRORS:
                raise LLMUnavailable(
                    f"LLM endpoint {self.config.base_url} failed in stage {self.stage}: {outcome.error}"
                )
            return outcome
        if key is not None:
            self._cache[key] = outcome.text
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache_path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"key": key, "text": outcome.text}, ensure_ascii=False) + "\n")
        return outcome
