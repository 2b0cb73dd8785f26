"""Fuzz the tool server with malformed and hostile requests over raw sockets.

Each request must get an HTTP status from its kind's expected set (a JSON ``{"error", "kind"}`` body
for our 4xx/5xx, a typed tool ``status`` for 200) within its deadline, or, for a client that never
completes its request, have its connection closed within the header timeout. Afterwards healthy
calls must still be answered correctly.
"""

from __future__ import annotations

import base64
import gzip
import json
import random
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import ToolEnvironment, VisualContext
from osvl.tools.client import RemoteToolPool
from osvl.tools.image_io import encode_png
from osvl.tools.server import ServerLimits, ToolServer
from tests.tools.test_hostile_inputs import gif_header_claiming, png_header_claiming

LIMITS = ServerLimits(
    max_request_bytes=1 << 20, header_timeout_s=1.0, body_timeout_s=1.0, write_timeout_s=5.0, max_connections=24
)
FAST_DEADLINE_S = 10.0  # generous: the machine running the tests is shared
SLOW_DEADLINE_S = LIMITS.header_timeout_s + 6.0
VARIANTS = 16


@dataclass(frozen=True)
class Probe:
    kind: str
    payload: bytes
    expect: frozenset[int]  # HTTP statuses that count as a typed answer; 0 = the server closes, no answer
    tool_status: str | None = None  # for 200: the tool status the body must carry
    trickle_s: float = 0.0  # pause between bytes (a slow client)
    half_close: bool = False
    deadline_s: float = FAST_DEADLINE_S


@dataclass
class Answer:
    status: int  # 0 when the connection closed without a status line
    headers: dict[str, str]
    body: bytes
    elapsed_s: float


def exchange(port: int, probe: Probe) -> Answer:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=probe.deadline_s) as sock:
        try:
            if probe.trickle_s:
                for i in range(len(probe.payload)):
                    sock.sendall(probe.payload[i : i + 1])
                    time.sleep(probe.trickle_s)
            else:
                sock.sendall(probe.payload)
            if probe.half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server hung up on us mid-request: what it sent before that still counts
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                if sep:
                    lengths = [
                        line.split(b":", 1)[1]
                        for line in head.split(b"\r\n")[1:]
                        if line.lower().startswith(b"content-length:")
                    ]
                    if lengths and len(body) >= int(lengths[0]):
                        break
        except ConnectionResetError:
            pass
    elapsed = time.monotonic() - started
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/1.") else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return Answer(status, headers, body, elapsed)


def request(
    body: bytes, *, path: str = "/v1/call", method: str = "POST", extra: str = "", length: str | None = None
) -> bytes:
    length_header = f"Content-Length: {len(body) if length is None else length}\r\n" if length != "" else ""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{length_header}{extra}\r\n".encode(
            "latin-1"
        )
        + body
    )


def call_body(tool: str = '"echo"', arguments: str = "{}", extra: str = "") -> bytes:
    return f'{{"tool": {tool}, "arguments": {arguments}{extra}}}'.encode()


def probes(rng: random.Random) -> list[Probe]:
    def n(low: int, high: int) -> int:
        return rng.randint(low, high)

    bad_400 = frozenset({400})
    kinds: dict[str, callable] = {
        "content_length_negative": lambda: Probe("", request(call_body(), length=f"-{n(1, 99)}"), bad_400),
        "content_length_not_a_number": lambda: Probe(
            "", request(call_body(), length=rng.choice(["abc", "1e3", "0x10", "12 34", "+5", "ten"])), bad_400
        ),
        "content_length_missing": lambda: Probe("", request(b"", length=""), frozenset({411})),
        "content_length_huge_declared": lambda: Probe(
            "", request(b"", length=str(n(2 << 20, 10**12))), frozenset({413})
        ),
        "content_length_overflows": lambda: Probe("", request(call_body(), length="9" * n(20, 60)), bad_400),
        "content_length_conflicting": lambda: Probe(
            "", request(call_body(), extra=f"Content-Length: {n(1, 5)}\r\n"), bad_400
        ),
        "content_length_with_chunked": lambda: Probe(
            "", request(b"0\r\n\r\n", extra="Transfer-Encoding: chunked\r\n"), bad_400
        ),
        "chunked_size_not_hex": lambda: Probe(
            "", request(b"zz\r\nabc\r\n0\r\n\r\n", length="", extra="Transfer-Encoding: chunked\r\n"), bad_400
        ),
        "request_line_garbage": lambda: Probe(
            "", rng.choice([b"HELLO\r\n\r\n", b"\x00\x01\x02\r\n\r\n", b"POST\r\n\r\n", b"GET / / /\r\n\r\n"]), bad_400
        ),
        "http_version_bogus": lambda: Probe(
            "",
            request(b"{}").replace(b"HTTP/1.1", rng.choice([b"HTTP/9.9", b"HTTP/1.x", b"HTTX/1.1"]), 1),
            frozenset({400, 505}),
        ),
        "header_line_too_long": lambda: Probe(
            "", request(b"{}", extra=f"X-Long: {'a' * n(9000, 40000)}\r\n"), frozenset({400, 431})
        ),
        "too_many_headers": lambda: Probe(
            "", request(b"{}", extra="".join(f"X-{i}: y\r\n" for i in range(n(200, 400)))), frozenset({400, 431})
        ),
        "method_not_allowed": lambda: Probe(
            "", request(b"{}", method=rng.choice(["PUT", "DELETE", "PATCH"])), frozenset({405})
        ),
        "path_unknown": lambda: Probe(
            "", request(b"{}", path=rng.choice(["/", "/v2/call", "/v1/call/x", "/%00"])), frozenset({404, 400})
        ),
        "body_not_json": lambda: Probe(
            "", request(rng.choice([b"{not json", b"[1,", b"tool=echo", b"{'a': 1}"])), bad_400
        ),
        "body_not_utf8": lambda: Probe("", request(bytes([0xFF, 0xFE, n(0, 255), 0x80]) + call_body()), bad_400),
        "body_nested_deep": lambda: Probe("", request(b"[" * n(50_000, 100_000) + b"]" * 10), bad_400),
        "body_not_an_object": lambda: Probe(
            "", request(rng.choice([b"[]", b'"echo"', b"42", b"null", b"true"])), bad_400
        ),
        "tool_not_a_string": lambda: Probe(
            "", request(call_body(tool=rng.choice(["1", "null", '["echo"]', "{}", "NaN", "9" * 5000]))), bad_400
        ),
        "deadline_unusable": lambda: Probe(
            "",
            request(
                call_body(
                    extra=', "deadline_s": '
                    + rng.choice(["-1", "0", "NaN", "Infinity", '"soon"', "9" * 5000, "1e999", "true"])
                )
            ),
            bad_400,
        ),
        "images_not_base64": lambda: Probe(
            "",
            request(call_body(tool='"echo_image"', arguments='{"image": 0}', extra=', "images": ["%%%", "@@"]')),
            bad_400,
        ),
        "image_decompression_bomb": lambda: Probe(
            "",
            request(
                call_body(
                    tool='"echo_image"',
                    arguments='{"image": 0}',
                    extra=', "images": ["'
                    + base64.b64encode(
                        rng.choice([png_header_claiming(100_000, 100_000), gif_header_claiming(65_535, 65_535)])
                    ).decode()
                    + '"]',
                )
            ),
            bad_400,
        ),
        "body_too_large": lambda: Probe(
            "", request(b'{"tool": "echo", "pad": "' + b"x" * n(1 << 20, 3 << 20) + b'"}'), frozenset({413})
        ),
        "body_gzip_encoded": lambda: Probe(
            "", request(gzip.compress(call_body()), extra="Content-Encoding: gzip\r\n"), bad_400
        ),
        "body_empty": lambda: Probe("", request(b""), bad_400),
        "arguments_huge_integer": lambda: Probe(
            "",
            request(call_body(arguments='{"seconds": ' + "9" * n(400, 6000) + "}")),
            frozenset({200}),
            "invalid_arguments",
        ),
        "arguments_non_finite": lambda: Probe(
            "",
            request(call_body(arguments='{"seconds": ' + rng.choice(["NaN", "Infinity", "-Infinity", "1e400"]) + "}")),
            frozenset({200}),
            "invalid_arguments",
        ),
        "arguments_lone_surrogate": lambda: Probe(
            "", request(call_body(arguments='{"tag": "a\\ud800"}')), frozenset({200}), "invalid_arguments"
        ),
        "arguments_wrong_type": lambda: Probe(
            "",
            request(call_body(arguments=rng.choice(['{"seconds": "1"}', '{"tag": 5}', "[1]", '"x"', '{"nope": 1}']))),
            frozenset({200}),
            "invalid_arguments",
        ),
        "tool_name_surrogate_or_unknown": lambda: Probe(
            "",
            request(call_body(tool=rng.choice(['"\\ud800"', '"\\udfff\\ud800"', '"nope"', '"' + "x" * 5000 + '"']))),
            frozenset({200}),
            "parse_error",
        ),
        "slow_body": lambda: Probe(
            "",
            request(b'{"tool": "echo", "arguments": {}}' + b" " * 40, length="200"),
            frozenset({408}),
            deadline_s=SLOW_DEADLINE_S,
        ),
        "slow_headers": lambda: Probe(
            "",
            b"POST /v1/call HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40,
            frozenset({0}),
            trickle_s=0.05,
            deadline_s=SLOW_DEADLINE_S,
        ),
        "body_cut_short": lambda: Probe(
            "", request(b'{"tool": "echo"', length=str(n(100, 1000))), frozenset({0, 400}), half_close=True
        ),
    }
    out = []
    for kind, make in kinds.items():
        for _ in range(VARIANTS):
            probe = make()
            out.append(
                Probe(
                    kind,
                    probe.payload,
                    probe.expect,
                    probe.tool_status,
                    probe.trickle_s,
                    probe.half_close,
                    probe.deadline_s,
                )
            )
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def fuzz_server(fault_pool, fault_registry):
    server = ToolServer(fault_registry, fault_pool, limits=LIMITS).start()
    yield server
    server.close()


def check(probe: Probe, answer: Answer) -> str | None:
    """Why this answer is not a typed answer in time, or None."""
    if answer.elapsed_s > probe.deadline_s:
        return f"answered after {answer.elapsed_s:.1f}s (deadline {probe.deadline_s}s)"
    if answer.status not in probe.expect:
        return f"status {answer.status}, expected one of {sorted(probe.expect)}: {answer.body[:160]!r}"
    if answer.status == 0 and probe.trickle_s and answer.elapsed_s < LIMITS.header_timeout_s * 0.5:
        return "closed before the header timeout"
    if answer.headers.get("content-type", "").startswith("application/json"):
        payload = json.loads(answer.body)
        if answer.status == 200 and payload.get("status") != probe.tool_status:
            return f"tool status {payload.get('status')}, expected {probe.tool_status}: {payload.get('error')}"
        if answer.status != 200 and not (payload.get("error") and payload.get("kind")):
            return f"error body without 'error' and 'kind': {payload}"
    elif answer.status in (200, 404, 405, 408, 411, 413):  # our own answers are always JSON
        return f"status {answer.status} without a JSON body"
    return None


def test_malformed_requests_each_get_a_typed_answer_in_time_and_the_server_keeps_serving(fuzz_server, fault_registry):
    port = int(fuzz_server.url.rsplit(":", 1)[1])
    batch = probes(random.Random(20))
    assert len(batch) >= 500 and len({p.kind for p in batch}) >= 20
    with ThreadPoolExecutor(max_workers=8) as callers:
        answers = list(callers.map(lambda probe: exchange(port, probe), batch))
    failures = [(p.kind, why) for p, a in zip(batch, answers) if (why := check(p, a)) is not None]
    assert not failures, (
        f"{len(failures)} of {len(batch)} untyped or late: {Counter(k for k, _ in failures)}; first: {failures[:3]}"
    )

    remote = RemoteToolPool(fuzz_server.url)
    env = ToolEnvironment(fault_registry, remote)
    context = VisualContext([np.full((5, 6, 3), 40, np.uint8)])
    result = env.execute_sync({"name": "echo_image", "arguments": {"image": 0, "tag": "after"}}, context)
    assert result.status is ToolStatus.OK and result.text.startswith("echo:after:"), result.error
    assert np.all(context.resolve(1) == 41) and result.worker.startswith(fuzz_server.url + " pid ")
    assert result.run_s > 0 and result.queue_s >= 0
    remote.close()


def test_connections_beyond_the_limit_get_503_and_the_server_recovers(fuzz_server):
    port = int(fuzz_server.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMITS.max_connections)]
    time.sleep(0.2)
    try:
        refused = [exchange(port, Probe("flood", request(call_body()), frozenset({503}))) for _ in range(30)]
        assert all(a.status == 503 and json.loads(a.body)["kind"] == "overloaded" for a in refused), Counter(
            a.status for a in refused
        )
    finally:
        for sock in idle:
            sock.close()
    healthy = Probe("healthy", request(call_body(arguments='{"tag": "ok"}')), frozenset({200}), "ok")
    deadline = time.monotonic() + 5
    while (answer := exchange(port, healthy)).status == 503 and time.monotonic() < deadline:
        time.sleep(0.05)  # the idle connections are being torn down
    assert check(healthy, answer) is None, answer


def test_idle_connections_are_closed_by_the_header_timeout(fuzz_server):
    port = int(fuzz_server.url.rsplit(":", 1)[1])
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=LIMITS.header_timeout_s + 6) as sock:
        assert sock.recv(1) == b""  # closed by the server, not by our timeout
    assert LIMITS.header_timeout_s * 0.5 <= time.monotonic() - started <= LIMITS.header_timeout_s + 6


def test_a_client_that_does_not_read_its_answer_is_dropped_and_others_are_served(fault_pool, fault_registry):
    limits = ServerLimits(write_timeout_s=0.5, header_timeout_s=30.0)
    server = ToolServer(fault_registry, fault_pool, limits=limits).start()
    port = int(server.url.rsplit(":", 1)[1])
    noise = np.random.default_rng(0).integers(0, 255, (700, 700, 3), dtype=np.uint8)
    image = base64.b64encode(encode_png(noise)).decode()
    body = call_body(tool='"echo_image"', arguments='{"image": 0}', extra=f', "images": ["{image}"]')
    big = f"POST /v1/call HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    try:
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        received, closed = 0, False
        try:
            for _ in range(6):  # ~8 MB of answers to a client that reads none of them
                stalled.sendall(big)
        except (ConnectionResetError, BrokenPipeError):
            closed = True  # dropped while still sending: the first answers already timed out
        healthy = Probe("healthy", request(call_body(arguments='{"tag": "ok"}')), frozenset({200}), "ok")
        assert check(healthy, exchange(port, healthy)) is None
        time.sleep(3 * limits.write_timeout_s + 2.0)  # the stalled answers are written (or given up on) by now
        stalled.settimeout(10.0)
        try:
            while chunk := stalled.recv(1 << 20):
                received += len(chunk)
            closed = True
        except (ConnectionResetError, BrokenPipeError):
            closed = True
        except TimeoutError:
            pass  # still open with nothing more to send: the server never gave up
        assert closed and received < 6 * len(image), (closed, received)
        stalled.close()
    finally:
        server.close()
