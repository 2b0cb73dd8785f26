"""Child-process targets for the start-up handshake tests; tiny imports so each spawn is quick."""

from __future__ import annotations

import os
import time


def ready(conn, payload) -> None:
    conn.send(("ready", payload))
    conn.recv()  # stay up until the parent hangs up


def report_failure(conn, message) -> None:
    conn.send(("failed", message))


def die(conn, code) -> None:
    os._exit(code)


def stay_silent(conn, seconds) -> None:
    time.sleep(seconds)
