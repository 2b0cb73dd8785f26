"""Serve a tool pool over HTTP so many rollout nodes share one set of tool workers.

Protocol (JSON): ``GET /v1/tools`` -> the OpenAI tool schemas; ``GET /v1/stats`` -> pool counters;
``POST /v1/call`` with ``{"tool", "arguments", "images": [base64 PNG], "deadline_s"}`` ->
``{"status", "text", "images", "error", "elapsed_s"}``. The client sends the images its call
references (resolved from its own visual context); the server looks the tool up in its own
registry (a client never names code to run), re-validates the arguments, and decodes images
under the pixel limit. ``RemoteToolPool`` is the client with the ``ToolPool`` calling interface,
so a ``ToolEnvironment`` runs unchanged against a remote server.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.tools.errors import CallParseError, ToolError
from osvl.tools.image_io import decode_image, encode_png
from osvl.tools.pool import Job, PoolStats, ToolPool
from osvl.tools.registry import ToolRegistry


def _encode_images(images: list[Any]) -> list[str]:
    return [base64.b64encode(encode_png(image)).decode("ascii") for image in images]


def _decode_images(encoded: Any, max_pixels: int) -> list[Any]:
    if not isinstance(encoded, list) or not all(isinstance(item, str) for item in encoded):
        raise ValueError("'images' must be a list of base64 PNG strings")
    try:
        return [decode_image(base64.b64decode(item, validate=True), max_pixels) for item in encoded]
    except binascii.Error as err:
        raise ValueError(f"an image is not valid base64: {err}") from None


def result_to_json(result: ToolResult) -> dict[str, Any]:
    return {
        "status": result.status.value,
        "tool": result.tool,
        "text": result.text,
        "images": _encode_images(result.images),
        "error": result.error,
        "elapsed_s": result.elapsed_s,
    }


def result_from_json(payload: dict[str, Any], max_pixels: int) -> ToolResult:
    return ToolResult(
        status=ToolStatus.parse(payload["status"]),
        tool=str(payload["tool"]),
        text=str(payload["text"]),
        images=_decode_images(payload["images"], max_pixels),
        error=payload.get("error"),
        elapsed_s=float(payload.get("elapsed_s", 0.0)),
    )


class ToolServer:
    def __init__(
        self,
        registry: ToolRegistry,
        pool: ToolPool,
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int = 64 << 20,
    ) -> None:
        self.registry, self.pool, self.max_request_bytes = registry, pool, max_request_bytes
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> ToolServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def handle_call(self, body: Any) -> tuple[int, dict[str, Any]]:
        """Run one call; protocol mistakes are HTTP 400, tool outcomes are always HTTP 200."""
        if not isinstance(body, dict) or not isinstance(body.get("tool"), str):
            return 400, {"error": "body must be a JSON object with a string 'tool'"}
        deadline_s = body.get("deadline_s")
        if deadline_s is not None and not (
            isinstance(deadline_s, (int, float)) and math.isfinite(deadline_s) and deadline_s > 0
        ):
            return 400, {"error": "'deadline_s' must be a positive number"}
        try:
            images = _decode_images(body.get("images", []), self.registry.limits.max_image_pixels)
        except ValueError as err:
            return 400, {"error": str(err)}
        name = body["tool"]
        try:
            call = self.registry.parse({"name": name, "arguments": body.get("arguments", {})})
            spec = self.registry.get(name)
        except CallParseError as err:
            return 200, result_to_json(ToolResult(ToolStatus.PARSE_ERROR, name, error=str(err)))
        except ToolError as err:
            return 200, result_to_json(ToolResult(ToolStatus.TOOL_ERROR, name, error=str(err)))
        if len(images) != len(spec.image_args):
            return 400, {"error": f"{name} takes {len(spec.image_args)} image(s), got {len(images)}"}
        job = Job(
            tool=name,
            target=spec.target,
            arguments=call.arguments,
            images=images,
            deadline_s=min(deadline_s or spec.deadline_s, spec.deadline_s * 4),
        )
        return 200, result_to_json(self.pool.call(job))

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                body = json.dumps(payload, ensure_ascii=False).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/tools":
                    self._send(200, server.registry.tool_schemas())
                elif self.path == "/v1/stats":
                    self._send(200, asdict(server.pool.stats))
                else:
                    self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:
                if self.path != "/v1/call":
                    return self._send(404, {"error": f"no route {self.path}"})
                length = int(self.headers.get("content-length") or 0)
                if length > server.max_request_bytes:
                    return self._send(413, {"error": f"request of {length} bytes exceeds {server.max_request_bytes}"})
                try:
                    body = json.loads(self.rfile.read(length))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return self._send(400, {"error": "body is not JSON"})
                self._send(*server.handle_call(body))

        return Handler


class RemoteToolPool:
    """``ToolPool``'s calling interface over HTTP; transport failures become ``infra_error``."""

    def __init__(self, url: str, max_image_pixels: int = 24_000_000, grace_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.max_image_pixels = max_image_pixels
        self.grace_s = grace_s  # transport allowance on top of the call's deadline
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._client = httpx.Client(trust_env=False)

    def call(self, job: Job) -> ToolResult:
        with self._lock:
            self.stats.submitted += 1
        body = {
            "tool": job.tool,
            "arguments": job.arguments,
            "images": _encode_images(job.images),
            "deadline_s": job.deadline_s,
        }
        try:
            response = self._client.post(f"{self.url}/v1/call", json=body, timeout=job.deadline_s + self.grace_s)
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
            result = result_from_json(response.json(), self.max_image_pixels)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            result = ToolResult(ToolStatus.INFRA_ERROR, job.tool, error=f"tool server failed: {err}")
        with self._lock:
            self.stats.completed += 1
        return result

    async def acall(self, job: Job) -> ToolResult:
        return await asyncio.to_thread(self.call, job)

    def tool_schemas(self) -> list[dict[str, Any]]:
        response = self._client.get(f"{self.url}/v1/tools", timeout=30)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m osvl.tools.server (--world DIR | --tools FILE.toml) [--port P]``: one node's tool server."""
    import argparse
    import signal

    from osvl.tools.pool import PoolConfig
    from osvl.tools.profiles import tool_profile

    parser = argparse.ArgumentParser(prog="python -m osvl.tools.server", description=main.__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--world", help="the embedded mini-world directory (offline back-ends)")
    source.add_argument("--tools", help="online back-ends: a TOML as `osvl.eval --tools` reads (*_key_env for keys)")
    parser.add_argument("--python-interpreter", action="store_true", help="also serve the sandboxed python tool")
    parser.add_argument("--workers", type=int, default=4, help="tool worker processes")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 = any free port (printed, and in --ready-file)")
    parser.add_argument("--ready-file", default="", help="write the server URL here once it serves")
    args = parser.parse_args(argv)
    from osvl.trainer.tool_env import online_tools_config, world_tools_config

    try:
        config = world_tools_config(args.world) if args.world else online_tools_config(args.tools)
    except ValueError as error:
        parser.error(str(error))
    profile = tool_profile("paper", config.limits, python_interpreter=args.python_interpreter)
    with ToolPool(config, PoolConfig(num_workers=args.workers, preload=profile.registry.targets())) as pool:
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
