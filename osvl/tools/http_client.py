"""One HTTP request with the retry policy every online tool backend shares.

429 and 5xx are retried (honouring ``Retry-After`` up to ``HttpConfig.max_retry_after_s``),
authentication failures and other 4xx are not; every failure ends as ``BackendError`` naming the
service and the cause, because an unreachable web service is never the policy's fault.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import httpx

from osvl.http_retry import retry_after_seconds
from osvl.tools.config import HttpConfig
from osvl.tools.errors import BackendError

RETRYABLE = frozenset({429, 500, 502, 503, 504})


@functools.cache
def shared_client(timeout_s: float) -> httpx.Client:
    """One pooled client per worker process and timeout (keeps connections alive across calls)."""
    return httpx.Client(timeout=timeout_s, trust_env=False)


def _backoff(config: HttpConfig, attempt: int) -> float:
    return min(config.backoff_s * 2**attempt, config.max_retry_after_s)


def request(
    service: str,
    method: str,
    url: str,
    config: HttpConfig,
    *,
    headers: dict[str, str] | None = None,
    json_body: Any = None,
    params: dict[str, Any] | None = None,
    client: httpx.Client | None = None,
) -> httpx.Response:
    client = client or shared_client(config.timeout_s)
    for attempt in range(config.max_retries + 1):
        last = attempt == config.max_retries
        try:
            response = client.request(method, url, headers=headers, json=json_body, params=params)
        except httpx.TimeoutException:
            if last:
                raise BackendError(f"{service} did not answer within {config.timeout_s:g}s") from None
            continue
        except httpx.HTTPError as err:
            if last:
                raise BackendError(f"{service} unreachable: {type(err).__name__}: {err}") from None
            time.sleep(_backoff(config, attempt))
            continue
        if response.status_code in (401, 403):
            raise BackendError(f"{service} rejected our credentials (HTTP {response.status_code})")
        if response.status_code in RETRYABLE:
            wait = retry_after_seconds(response.headers.get("retry-after"))
            if wait is not None and wait > config.max_retry_after_s:
                raise BackendError(f"{service} asked us to retry after {wait:g}s (HTTP {response.status_code})")
            if last:
                raise BackendError(
                    f"{service} failed with HTTP {response.status_code} after {config.max_retries + 1} attempts"
                )
            time.sleep(wait if wait is not None else _backoff(config, attempt))
            continue
        if response.status_code >= 400:
            raise BackendError(f"{service} answered HTTP {response.status_code}: {response.text[:200]}")
        return response
    raise AssertionError("unreachable")


def request_json(service: str, method: str, url: str, config: HttpConfig, **kwargs: Any) -> Any:
    response = request(service, method, url, config, **kwargs)
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BackendError(f"{service} sent a body that is not JSON: {response.text[:120]!r}") from None
