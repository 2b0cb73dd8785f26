"""Judges for the accuracy reward ``r_acc`` and the query-quality reward ``r_query``.

Two kinds of each: an LLM judge that talks to any OpenAI-compatible ``/chat/completions``
endpoint (base URL, model and key from config), and offline judges (normalized exact/alias
match; a search-process heuristic, or the evidence chain a chain question asks for) for tests
and the demo.

A judge never raises and never guesses: when it cannot produce a verdict (timeouts, 5xx or 429
past the retry budget, auth failures, malformed bodies, unparsable model output) it returns a
:class:`Verdict` with ``score=None`` and a reason, and the sample is excluded from its group.
With ``ChatJudgeConfig.overload_wait_s`` an endpoint's overload answers (429, 503) are back-pressure:
asked again (after its Retry-After) without using up attempts for that long, and only then unscored,
with the reason ``overloaded_http_<status>``; every verdict says how many it met (``overloads``).
"""

from __future__ import annotations

import email.utils
import json
import math
import re
import string
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Protocol

import httpx

from osvl.rl.trajectory import Prompt, Step, ToolStatus

# ---------------------------------------------------------------------------------------------
# Verdicts and judge interfaces


@dataclass(frozen=True)
class Verdict:
    """A judge's answer: ``score`` in [0, 1], or None with ``reason`` when it could not judge."""

    score: float | None
    reason: str = ""
    attempts: int = 0  # HTTP requests made (0 for offline judges)
    judge: str = ""  # which judge and prompt version produced it
    overloads: int = 0  # overload answers (429, 503) among the requests, waited out as back-pressure

    @property
    def scored(self) -> bool:
        return self.score is not None


class AccuracyJudge(Protocol):
    def judge_answer(self, prompt: Prompt, response: str) -> Verdict: ...


class QueryJudge(Protocol):
    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict: ...


def load_prompt(name: str) -> string.Template:
    """A versioned judge prompt from ``osvl/rl/prompts`` (``$name`` placeholders)."""
    text = resources.files("osvl.rl").joinpath("prompts", name).read_text(encoding="utf-8")
    return string.Template(text)


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible chat client


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


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP-date), if valid."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return None if math.isnan(seconds) else max(seconds, 0.0)


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
                    retry_after = parse_retry_after(reply.headers.get("retry-after"))
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


# ---------------------------------------------------------------------------------------------
# LLM judges


_VERDICT_LINE = re.compile(r"verdict\s*[:=]\s*\**\s*(correct|incorrect)\b", re.IGNORECASE)
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
QUERY_DIMENSIONS = ("relevance", "progression", "signal_to_noise", "cross_modal")


def parse_accuracy_verdict(text: str) -> float | None:
    """1.0 / 0.0 from the last ``verdict: correct|incorrect`` line, None if absent."""
    matches = _VERDICT_LINE.findall(text)
    if not matches:
        return None
    return 1.0 if matches[-1].lower() == "correct" else 0.0


def parse_query_scores(text: str) -> float | None:
    """Mean of the four 0-10 rubric scores in the last JSON object, scaled to [0, 1]."""
    for candidate in reversed(_JSON_OBJECT.findall(text)):
        try:
            scores = json.loads(candidate)
        except ValueError:
            continue
        if not isinstance(scores, dict):
            continue
        values = [scores.get(name) for name in QUERY_DIMENSIONS]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 10 for v in values):
            return sum(values) / (10.0 * len(values))
        return None
    return None


class LLMAccuracyJudge:
    """``r_acc`` from a chat model asked whether the response matches the reference."""

    def __init__(self, client: ChatCompletionsClient, prompt_file: str = "accuracy_judge.v1.txt") -> None:
        self.client = client
        self.template = load_prompt(prompt_file)
        self.name = f"chat:{client.config.model}:{prompt_file.removesuffix('.txt')}"

    def judge_answer(self, prompt: Prompt, response: str) -> Verdict:
        message = self.template.substitute(
            question=prompt.question, references="\n".join(f"- {a}" for a in prompt.accepted_answers), response=response
        )
        outcome = self.client.complete([{"role": "user", "content": message}])
        if outcome.text is None:
            return Verdict(None, outcome.error or "", outcome.attempts, self.name, outcome.overloads)
        score = parse_accuracy_verdict(outcome.text)
        if score is None:
            return Verdict(None, "unparsable_verdict", outcome.attempts, self.name, outcome.overloads)
        return Verdict(score, outcome.text[-200:], outcome.attempts, self.name, outcome.overloads)


def describe_calls(steps: Sequence[Step], excerpt_chars: int = 400) -> str:
    """Numbered, human-readable list of the tool calls in ``steps`` for the query judge."""
    lines = []
    for step in steps:
        result = step.tool_result
        if step.tool_call is None and result is None:
            continue
        if step.tool_call is not None:
            action = f"{step.tool_call.name} {json.dumps(step.tool_call.arguments, ensure_ascii=False)}"
        else:
            action = "(unparsable action)"
        if result is None:
            outcome = "not executed"
        elif result.ok:
            shown = result.text[:excerpt_chars] + ("..." if len(result.text) > excerpt_chars else "")
            images = f" [+{len(result.images)} image(s)]" if result.images else ""
            outcome = f"ok: {shown}{images}"
        else:
            outcome = f"{result.status.value}: {result.error or ''}"
        lines.append(f"{len(lines) + 1}. {action} -> {outcome}")
    return "\n".join(lines)


class LLMQueryJudge:
    """``r_query`` from a chat model scoring the search process on the four-dimension rubric."""

    def __init__(
        self, client: ChatCompletionsClient, prompt_file: str = "query_judge.v1.txt", excerpt_chars: int = 400
    ) -> None:
        self.client = client
        self.template = load_prompt(prompt_file)
        self.excerpt_chars = excerpt_chars
        self.name = f"chat:{client.config.model}:{prompt_file.removesuffix('.txt')}"

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        message = self.template.substitute(question=prompt.question, calls=describe_calls(steps, self.excerpt_chars))
        outcome = self.client.complete([{"role": "user", "content": message}])
        if outcome.text is None:
            return Verdict(None, outcome.error or "", outcome.attempts, self.name, outcome.overloads)
        score = parse_query_scores(outcome.text)
        if score is None:
            return Verdict(None, "unparsable_verdict", outcome.attempts, self.name, outcome.overloads)
        return Verdict(score, outcome.text[-200:], outcome.attempts, self.name, outcome.overloads)


# ---------------------------------------------------------------------------------------------
# Offline judges

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Casefolded NFKC text without punctuation, English articles or extra whitespace."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


class ExactMatchAccuracyJudge:
    """Offline ``r_acc``: 1 when the normalized response equals the answer or an alias."""

    name = "offline:exact_match"

    def judge_answer(self, prompt: Prompt, response: str) -> Verdict:
        accepted = {normalize_answer(a) for a in prompt.accepted_answers} - {""}
        hit = normalize_answer(response) in accepted
        return Verdict(1.0 if hit else 0.0, "match" if hit else "no match", 0, self.name)


_QUERY_ARGUMENTS = ("query", "queries", "q", "search_query")
_VISUAL_TOOL_WORDS = ("image", "crop", "ocr", "sharpen", "super", "perspective", "zoom")
_STOPWORDS = frozenset(
    "the a an of in on at to for from by with and or is are was were be this that what which who "
    "whom whose when where why how did does do it its as into than then".split()
)


def _text_queries(step: Step) -> list[str]:
    if step.tool_call is None:
        return []
    found: list[str] = []
    for key in _QUERY_ARGUMENTS:
        value = step.tool_call.arguments.get(key)
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, list):
            found.extend(v for v in value if isinstance(v, str))
    return found


def _content_words(text: str) -> set[str]:
    return {w for w in normalize_answer(text).split() if len(w) > 2 and w not in _STOPWORDS}


class HeuristicQueryJudge:
    """Offline ``r_query``: a deterministic stand-in for the rubric, mean of four proxies in [0, 1].

    relevance: share of text queries with a content word from the question; progression: share
    of calls that are not exact repeats; signal_to_noise: share of calls that returned something;
    cross_modal: 1 when visual tools and text search are both used, 0.5 for one kind, else 0.
    """

    name = "offline:query_heuristic"

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        calls = [s for s in steps if s.tool_call is not None or s.tool_result is not None]
        if not calls:
            return Verdict(0.0, "no tool calls", 0, self.name)
        question_words = _content_words(prompt.question)
        queries = [q for s in calls for q in _text_queries(s)]
        relevance = sum(bool(_content_words(q) & question_words) for q in queries) / len(queries) if queries else 0.0
        keys = [
            json.dumps([s.tool_call.name, s.tool_call.arguments], sort_keys=True, default=str)
            if s.tool_call is not None
            else f"unparsed:{i}"
            for i, s in enumerate(calls)
        ]
        progression = len(set(keys)) / len(keys)
        signal = sum(
            s.tool_result is not None
            and s.tool_result.status is ToolStatus.OK
            and bool(s.tool_result.text.strip() or s.tool_result.images)
            for s in calls
        ) / len(calls)
        names = [s.tool_call.name.lower() for s in calls if s.tool_call is not None]
        uses_visual = any(word in name for name in names for word in _VISUAL_TOOL_WORDS)
        uses_text = any(
            _text_queries(s) and "image" not in s.tool_call.name.lower() for s in calls if s.tool_call is not None
        )
        cross_modal = (uses_visual + uses_text) / 2.0
        score = (relevance + progression + signal + cross_modal) / 4.0
        return Verdict(
            score,
            f"relevance={relevance:.2f} progression={progression:.2f} "
            f"signal={signal:.2f} cross_modal={cross_modal:.2f}",
            0,
            self.name,
        )


# The demo world's question and observation forms (osvl.synth.drills, osvl.tools): "What is the
# <attribute> of the <relation k> of ... of the <relation 1> of the <kind> shown in the image?" (or "... of
# <Name>?"), image_search's "[Match 1] <Title> (page: ...", text_search's "The <relation> of <Title> is <X>."
_CHAIN_QUESTION = re.compile(r"^What is the (?P<body>.+)\?$")
_SHOWN = " shown in the image"
_TOP_MATCH_TITLE = re.compile(r"^\[Match 1\] (.+?) \(page: ", re.MULTILINE)


def question_lookups(question: str) -> tuple[str | None, list[str]] | None:
    """(start entity, lookups) a chain question asks for: the relations from the start outwards, then the
    attribute; the start is None when it is the entity shown in the image. None for any other question."""
    found = _CHAIN_QUESTION.match(question.strip())
    if found is None:
        return None
    pieces = found.group("body").split(" of the ")
    if pieces[-1].endswith(_SHOWN):
        start, asked = None, pieces[:-1]  # attribute, relation k, ..., relation 1
    else:
        last, sep, start = pieces[-1].partition(" of ")
        if not sep or not start:
            return None
        asked = [*pieces[:-1], last]
    return (start, [*reversed(asked[1:]), asked[0]]) if asked else None


def _stated_targets(observation: str, relation: str, title: str) -> set[str]:
    pattern = re.compile(rf"The {re.escape(relation)} of {re.escape(title)} is ([^.\n]+)\.")
    return set(pattern.findall(observation))


def chain_progress(question: str, steps: Sequence[Step]) -> tuple[int, int] | None:
    """(lookups issued, lookups asked) of a chain question, or None for a question of another form: each
    lookup counts when issued, in order, on the entity the agent's own evidence named (the image search's top
    match, then each passage's "The <relation> of <entity> is <next>."), never looking at the reference."""
    parsed = question_lookups(question)
    if parsed is None:
        return None
    current, lookups = parsed
    done = 0
    for step in steps:
        if step.tool_call is None or step.tool_result is None or step.tool_result.status is not ToolStatus.OK:
            continue
        observation = step.tool_result.text
        if "image" in step.tool_call.name.lower() and current is None and done == 0:
            top = _TOP_MATCH_TITLE.search(observation)
            current = top.group(1) if top else None
            continue
        if current is None or done == len(lookups):
            continue
        wanted = lookups[done]
        query_words = set(normalize_answer(" ".join(_text_queries(step))).split())
        if not query_words or not set(normalize_answer(f"{current} {wanted}").split()) <= query_words:
            continue
        done += 1
        if done < len(lookups):
            targets = _stated_targets(observation, wanted, current)
            current = targets.pop() if len(targets) == 1 else None  # no single next entity: the chain ends
    return done, len(lookups)


class EvidenceChainQueryJudge:
    """Offline ``r_query`` for chain questions: the share of the lookups the question asks for that the agent
    issued (:func:`chain_progress`).

    It grades relevance and progression as a careful reader of the calls would: "Jorlo Talcor founder" after
    the image search named Jorzel Zoo earns nothing for the question's "founder of the zoo", even though both
    names appear in the caption. A question outside the chain form gets :class:`HeuristicQueryJudge`'s score.
    """

    name = "offline:query_chain"

    def __init__(self) -> None:
        self._fallback = HeuristicQueryJudge()

    def judge_queries(self, prompt: Prompt, steps: Sequence[Step]) -> Verdict:
        progress = chain_progress(prompt.question, steps)
        if progress is None:
            return self._fallback.judge_queries(prompt, steps)
        done, asked = progress
        return Verdict(done / asked, f"lookups {done}/{asked}", 0, self.name)
