"""``Retry-After`` as every waiting client reads it: delta-seconds or an HTTP date, never below 0, None when
absent or unreadable."""

from __future__ import annotations

from datetime import UTC, datetime

from osvl.http_retry import retry_after_seconds


def test_retry_after_seconds() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_seconds("5") == 5.0
    assert retry_after_seconds(" 1.5 ") == 1.5
    assert retry_after_seconds("-3") == 0.0
    assert retry_after_seconds("Thu, 01 Jan 2026 12:00:30 GMT", now=now) == 30.0
    assert retry_after_seconds("Thu, 01 Jan 2026 12:00:30 -0000", now=now) == 30.0  # zoneless: GMT
    assert retry_after_seconds("Thu, 01 Jan 2026 11:00:00 GMT", now=now) == 0.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("nan") is None
    assert retry_after_seconds("") is None
    assert retry_after_seconds(None) is None
