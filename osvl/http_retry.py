"""An HTTP server's ``Retry-After``, read once for every client that waits on one: the judges' chat
client (``osvl.rl.chat_client``), the online tool back-ends (``osvl.tools.http_client``) and the tool
server's client (``osvl.tools.client``)."""

from __future__ import annotations

import email.utils
import math
from datetime import UTC, datetime


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date, a zoneless one
    read as GMT as HTTP dates are), never below 0; None when absent or unreadable."""
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
