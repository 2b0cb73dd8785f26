"""Serve a tool pool over HTTP so many rollout nodes share one set of tool workers.

The wire format is ``osvl.tools.wire``'s; the client is ``osvl.tools.client.RemoteToolPool``. The
server looks the tool up in its own registry (a client never names code to run), re-validates the
arguments, and decodes images under the byte and pixel limits.

Overload is back-pressure, not a failure: a full queue (or too many connections) answers 503 with
kind ``overloaded``, a ``Retry-After`` header (whole seconds, as HTTP has it) and, for a full queue,
``retry_after_s``, the server's estimate of when a queue slot frees (its recent run time over its
workers). Nothing ran, so the client asks again after that long, within the call's own deadline.

The HTTP stack is aiohttp: its C parser (llhttp) rejects malformed framing (a ``Content-Length`` that
is negative, not a number or repeated, chunked encoding mixed with a length) with 400 before our
code runs, ``client_max_size`` answers oversized bodies with 413, and its idle timer, armed when a
connection opens, closes a client that has not finished sending its headers in time. On top, this
module bounds the time to receive a body (408), the number of open connections (503 beyond), the time
to write an answer to a client that does not read, and the time any call may take in queue and run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from osvl.rl.trajectory import ToolResult
from osvl.tools.call_json import loads_call_json, reject_unusable
from osvl.tools.errors import CallParseError, InvalidArguments, ToolError, error_status
from osvl.tools.pool import Job, PoolBusy, PoolClosed, ToolPool
from osvl.tools.registry import ToolRegistry
from osvl.tools.wire import INSTANCE_HEADER, decode_images, dumps, result_to_json


class _ClientFaults(logging.Filter):
    """aiohttp logs every malformed request or dropped client as an error with a traceback; those are
    the client's faults, answered with 4xx already, so only our own errors reach the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, (HttpProcessingError, ConnectionError, RequestPayloadError))


_HTTP_LOG = logging.getLogger("osvl.tools.server.http")
_HTTP_LOG.addFilter(_ClientFaults())
_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}
MIN_RETRY_AFTER_S = 0.01  # the shortest wait a full queue asks for


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 64 << 20  # a body over this is refused with 413 before it is read in full
    header_timeout_s: float = 10.0  # a connection must finish its request headers (or idle) within this
    body_timeout_s: float = 30.0  # ... and its body within this, else 408
    write_timeout_s: float = 30.0  # a client that does not read its answer within this is disconnected
    max_connections: int = 256  # open connections; more get 503 and are closed
    max_queue_wait_s: float = 5.0  # a call's time in the pool's queue, on top of its own deadline
    max_deadline_factor: float = 4.0  # a client may ask for at most this multiple of a tool's own deadline

    def __post_init__(self) -> None:
        for name in (
            "header_timeout_s",
            "body_timeout_s",
            "write_timeout_s",
            "max_queue_wait_s",
            "max_deadline_factor",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ServerLimits.{name} must be a positive number, got {value}")
        if self.max_request_bytes < 1 or self.max_connections < 1:
            raise ValueError("ServerLimits.max_request_bytes and max_connections must be >= 1")


class _BadRequest(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _printable(name: str) -> str:
    """A tool name fit to echo back: the policy's unknown name may hold lone surrogates or be huge."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return ""
    return name[:200]


def _positive_seconds(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise _BadRequest(400, "bad_field", f"'{key}' must be a positive number")
    return float(value)


class ToolServer:
    def __init__(
        self,
        registry: ToolRegistry,
        pool: ToolPool,
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        limits = limits or ServerLimits()
        if max_request_bytes is not None:
            limits = ServerLimits(**{**asdict(limits), "max_request_bytes": max_request_bytes})
        self.registry, self.pool, self.limits = registry, pool, limits
        self._socket = socket.create_server((host, port), backlog=max(128, limits.max_connections))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="osvl-tool-server")
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._startup_error: BaseException | None = None
        self._recent_run_s = 0.0  # moving average of the calls' run seconds (the event loop's thread only)
        self.instance = uuid.uuid4().hex  # tells a client a restarted server from the one it knew

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self) -> ToolServer:
        self._thread.start()
        self._ready.wait(30)
        if self._startup_error is not None:
            raise RuntimeError(f"tool server failed to start: {self._startup_error}")
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._socket.close()

    # -- the event loop thread ------------------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._startup())
        except BaseException as err:  # noqa: BLE001 - reported by start()
            self._startup_error = err
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _startup(self) -> None:
        app = web.Application(client_max_size=self.limits.max_request_bytes, middlewares=[self._json_errors])
        app.router.add_get("/v1/tools", self._tools)
        app.router.add_get("/v1/stats", self._stats)
        app.router.add_post("/v1/call", self._call)
        app.on_response_prepare.append(self._stamp)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            auto_decompress=False,
            keepalive_timeout=self.limits.header_timeout_s,
            lingering_time=1.0,
            logger=_HTTP_LOG,
        )
        await self._runner.setup()
        self._server = await self._loop.create_server(self._protocol, sock=self._socket)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _protocol(self) -> asyncio.Protocol:
        """aiohttp's connection handler, or a 503 when ``max_connections`` are already open."""
        manager = self._runner.server
        if len(manager.connections) >= self.limits.max_connections:
            return _Overloaded(self.limits.max_connections, self.instance)
        return manager()

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[INSTANCE_HEADER] = self.instance

    # -- routes ---------------------------------------------------------------------------------

    @web.middleware
    async def _json_errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The router's own refusals (unknown path, wrong method) as JSON like every other answer."""
        try:
            return await handler(request)
        except web.HTTPException as err:
            if err.status < 400:
                raise
            return await self._error(
                request,
                err.status,
                _KINDS.get(err.status, "bad_request"),
                f"{err.reason}: {request.method} {request.path[:200]}",
            )

    async def _reply(
        self, request: web.Request, status: int, payload: Any, headers: dict[str, str] | None = None
    ) -> web.StreamResponse:
        """Write the answer here, under the write timeout: a client that does not read is dropped."""
        response = web.Response(status=status, body=dumps(payload), content_type="application/json", headers=headers)

        async def write() -> None:
            await response.prepare(request)
            await response.write_eof()

        try:
            await asyncio.wait_for(write(), self.limits.write_timeout_s)
        except (TimeoutError, ConnectionError):
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _error(self, request: web.Request, status: int, kind: str, message: str) -> web.StreamResponse:
        return await self._reply(request, status, {"error": message, "kind": kind})

    async def _tools(self, request: web.Request) -> web.StreamResponse:
        return await self._reply(request, 200, self.registry.tool_schemas())

    async def _stats(self, request: web.Request) -> web.StreamResponse:
        return await self._reply(request, 200, asdict(self.pool.stats))

    async def _call(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._read_json(request)
            prepared = await asyncio.to_thread(self._prepare, body)
        except _BadRequest as err:
            return await self._error(request, err.status, err.kind, str(err))
        if not isinstance(prepared, Job):
            return await self._reply(request, 200, result_to_json(prepared))
        try:
            future = self.pool.submit(prepared, block=False)
        except PoolBusy as err:
            wait = max(MIN_RETRY_AFTER_S, self._recent_run_s / self.pool.config.num_workers)
            payload = {"error": str(err), "kind": "overloaded", "retry_after_s": round(wait, 4)}
            return await self._reply(request, 503, payload, {"Retry-After": str(math.ceil(wait))})
        except PoolClosed as err:
            return await self._error(request, 503, "closed", str(err))
        backstop = prepared.end_to_end_s + self.limits.max_queue_wait_s
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), backstop)
        except TimeoutError:
            future.cancel()
            return await self._error(request, 504, "deadline", f"{prepared.tool} got no answer within {backstop:g}s")
        self._recent_run_s += 0.2 * (result.run_s - self._recent_run_s)
        payload = await asyncio.to_thread(result_to_json, result)
        return await self._reply(request, 200, payload)

    async def _read_json(self, request: web.Request) -> Any:
        if request.content_length is None and "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
            raise _BadRequest(411, "length_required", "a POST needs a Content-Length (or chunked encoding)")
        if request.content_length is not None and request.content_length > self.limits.max_request_bytes:
            raise _BadRequest(
                413, "too_large", f"a body of {request.content_length} bytes exceeds {self.limits.max_request_bytes}"
            )
        try:
            raw = await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
        except TimeoutError:
            raise _BadRequest(
                408, "timeout", f"the body did not arrive within {self.limits.body_timeout_s:g}s"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise _BadRequest(413, "too_large", f"the body exceeds {self.limits.max_request_bytes} bytes") from None
        except (RequestPayloadError, ConnectionError) as err:  # the body broke off, or its chunked framing is wrong
            raise _BadRequest(400, "malformed_body", f"the body could not be read: {err}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _BadRequest(
                400, "malformed_body", f"the body is not UTF-8: {err.reason} at byte {err.start}"
            ) from None
        try:
            return loads_call_json(text, "the body")
        except (CallParseError, InvalidArguments) as err:
            raise _BadRequest(400, "malformed_body", str(err)) from None

    def _prepare(self, body: Any) -> Job | ToolResult:
        """The job to run, the typed result that ends the call here, or ``_BadRequest``."""
        if not isinstance(body, dict) or not isinstance(body.get("tool"), str):
            raise _BadRequest(400, "bad_field", "body must be a JSON object with a string 'tool'")
        try:  # the arguments are the policy's (typed below); a protocol field with such a number is the client's
            reject_unusable({key: value for key, value in body.items() if key != "arguments"}, "")
        except InvalidArguments as err:
            raise _BadRequest(400, "bad_field", f"body field {str(err).removeprefix('argument ')}") from None
        deadline_s = _positive_seconds(body, "deadline_s")
        end_to_end_s = _positive_seconds(body, "end_to_end_s")
        try:
            images = decode_images(
                body.get("images", []), self.registry.limits.max_image_pixels, self.registry.limits.max_image_bytes
            )
        except ValueError as err:
            raise _BadRequest(400, "bad_images", str(err)) from None
        name = body["tool"]
        try:
            call = self.registry.parse({"name": name, "arguments": body.get("arguments", {})})
            spec = self.registry.get(name)
        except (CallParseError, ToolError) as err:
            return ToolResult(error_status(err), _printable(name), error=str(err))
        if len(images) != len(spec.image_args):
            raise _BadRequest(400, "bad_images", f"{name} takes {len(spec.image_args)} image(s), got {len(images)}")
        deadline = min(deadline_s or spec.deadline_s, spec.deadline_s * self.limits.max_deadline_factor)
        queue_bound = deadline + self.limits.max_queue_wait_s
        return Job(
            tool=name,
            target=spec.target,
            arguments=call.arguments,
            images=images,
            deadline_s=deadline,
            options=dict(spec.options),
            end_to_end_s=min(end_to_end_s or queue_bound, queue_bound),
        )

    def handle_call(self, body: Any) -> tuple[int, dict[str, Any]]:
        """One call without HTTP (same checks, blocking): protocol mistakes are 4xx, tool outcomes 200."""
        try:
            prepared = self._prepare(body)
        except _BadRequest as err:
            return err.status, {"error": str(err), "kind": err.kind}
        if isinstance(prepared, Job):
            prepared = self.pool.call(prepared)
        return 200, result_to_json(prepared)


class _Overloaded(asyncio.Protocol):
    """Answers a connection over the limit with 503 and closes it, without reading its request."""

    def __init__(self, limit: int, instance: str) -> None:
        body = dumps({"error": f"the tool server has {limit} open connections; retry later", "kind": "overloaded"})
        self._answer = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Retry-After: 1\r\n{INSTANCE_HEADER}: {instance}\r\n".encode()
            + b"Content-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self._answer)
        transport.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m osvl.tools.server (--world DIR | --tools FILE.toml) [--port P]``: one node's tool server."""
    import argparse
    import signal

    from osvl.tools.pool import PoolConfig
    from osvl.tools.profiles import tool_profile
    from osvl.tools.sandbox import BACKENDS, SandboxConfig, SandboxUnavailable, check_sandbox

    parser = argparse.ArgumentParser(prog="python -m osvl.tools.server", description=main.__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--world", help="the embedded mini-world directory (offline back-ends)")
    source.add_argument(
        "--tools", help="online back-ends: a TOML path or a shipped name (online), as `osvl.eval --tools` reads"
    )
    parser.add_argument("--python-interpreter", action="store_true", help="also serve the sandboxed python tool")
    parser.add_argument(
        "--python-sandbox",
        choices=BACKENDS,
        default="namespaces",
        help="the boundary python_interpreter runs behind (unsafe_no_boundary: none)",
    )
    parser.add_argument("--sandbox-fusion-url", default="", help="SandboxFusion base URL for sandbox_fusion")
    parser.add_argument("--workers", type=int, default=4, help="tool worker processes")
    parser.add_argument(
        "--max-queue",
        type=int,
        default=PoolConfig().max_queue,
        help="calls waiting for a worker; more are answered 503 overloaded (clients ask again)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 = any free port (printed, and in --ready-file)")
    parser.add_argument("--ready-file", default="", help="write the server URL here once it serves")
    args = parser.parse_args(argv)
    from osvl.tools.config_file import online_tools_config
    from osvl.tools.world import world_tools_config

    try:
        config = world_tools_config(args.world) if args.world else online_tools_config(args.tools)
        sandbox = SandboxConfig(backend=args.python_sandbox, fusion_url=args.sandbox_fusion_url)
        if args.python_interpreter:
            check_sandbox(sandbox)
    except (ValueError, SandboxUnavailable) as error:
        parser.error(str(error))
    profile = tool_profile("paper", config.limits, python_interpreter=args.python_interpreter, sandbox=sandbox)
    pool_config = PoolConfig(num_workers=args.workers, max_queue=args.max_queue, preload=profile.registry.targets())
    with ToolPool(config, pool_config) as pool:
        server = ToolServer(profile.registry, pool, args.host, args.port).start()
        print(f"osvl tool server on {server.url}: {', '.join(profile.registry.names)}", flush=True)
        if args.ready_file:
            from pathlib import Path

            tmp = Path(args.ready_file).with_suffix(".tmp")
            tmp.write_text(server.url)
            tmp.replace(args.ready_file)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        server.close()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
