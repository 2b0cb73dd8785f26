"""A loopback server speaking SGLang's native protocol, backed by the local engine: tests and the
offline demo exercise the SGLang client without a GPU.

It answers ``POST /generate``, ``POST /update_weights_from_disk``, ``GET /health`` and
``GET /get_server_info`` (the fields the client reads: deterministic inference is the local
engine's ``deterministic``) with SGLang's JSON shapes (the fields are listed in
:mod:`osvl.rollout.sglang`). Differences:
``/update_weights_from_disk`` reads a ``torch.save``'d state dict (SGLang reads an HF checkpoint
directory), and request fields the local engine cannot honor (prompt logprobs, top-k, penalties,
``logit_bias``, batches) are refused with HTTP 400 rather than silently ignored.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

import torch

from osvl.data.image import decode_image, process_image
from osvl.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
)
from osvl.rollout.local_engine import LocalEngine

SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "stop", "stop_token_ids", "sampling_seed",
                           "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"})
REQUEST_KEYS = frozenset({"input_ids", "image_data", "sampling_params", "return_logprob", "logprob_start_len",
                          "return_text_in_logprobs", "rid", "stream"})
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


def _or_default(params: dict[str, Any], key: str, default: Any) -> Any:
    """SGLang treats an explicit null like an absent key."""
    value = params.get(key)
    return default if value is None else value


def request_from_json(body: Any, engine: LocalEngine) -> GenerationRequest:
    """The local request a ``/generate`` body asks for; ValueError names what is not supported."""
    if not isinstance(body, dict):
        raise ValueError(f"/generate body must be a JSON object, got {type(body).__name__}")  # noqa: TRY004 (bad input)
    unknown = sorted(set(body) - REQUEST_KEYS)
    if unknown:
        raise ValueError(f"/generate fields not supported by the loopback server: {unknown}")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError("input_ids must be one non-empty flat list of ints (batches are not supported)")
    if body.get("stream"):
        raise ValueError("streaming is not supported by the loopback server")
    if _or_default(body, "logprob_start_len", -1) != -1:
        raise ValueError("only logprob_start_len = -1 (output logprobs) is supported")
    s = _or_default(body, "sampling_params", {})
    if not isinstance(s, dict):
        raise ValueError("sampling_params must be one JSON object (batches are not supported)")  # noqa: TRY004 (bad input)
    unknown = sorted(set(s) - SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"sampling_params not supported by the loopback server: {unknown}")
    stop = _or_default(s, "stop", ())
    sampling = SamplingParams(
        temperature=float(_or_default(s, "temperature", 1.0)), top_p=float(_or_default(s, "top_p", 1.0)),
        max_new_tokens=int(_or_default(s, "max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(int(i) for i in _or_default(s, "stop_token_ids", ())),
        seed=None if s.get("sampling_seed") is None else int(s["sampling_seed"]))
    urls = _or_default(body, "image_data", [])
    if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
        raise ValueError("image_data must be a list of base64 strings or data URLs (one request's images)")
    images = []
    for url in urls:
        data = base64.b64decode(url.split(",", 1)[1] if url.startswith("data:") else url)
        images.append(process_image(decode_image(data), engine.image_config))
    return GenerationRequest(ids, images, sampling)


def finish_reason(result: GenerationResult, request: GenerationRequest, engine: LocalEngine) -> dict[str, Any]:
    """SGLang's ``finish_reason``: the stop id or stop string that matched, or the length reached."""
    if result.finish is StopKind.LENGTH:
        return {"type": "length", "length": len(result.token_ids)}
    last = result.token_ids[-1]
    if last in request.sampling.stop_token_ids:
        return {"type": "stop", "matched": last}
    text = engine.tokenizer.decode(result.token_ids)
    return {"type": "stop", "matched": next((s for s in request.sampling.stop if s in text), None)}


def response_json(result: GenerationResult, request: GenerationRequest, body: dict[str, Any],
                  engine: LocalEngine, rid: str) -> dict[str, Any]:
    skip = _or_default(_or_default(body, "sampling_params", {}), "skip_special_tokens", True)
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish_reason(result, request, engine), "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.token_ids), "cached_tokens": 0, "weight_version": str(result.policy_version)}
    if body.get("return_logprob"):
        with_text = bool(body.get("return_text_in_logprobs"))
        meta["output_token_logprobs"] = [
            [lp, t, engine.tokenizer.decode([t]) if with_text else None]
            for lp, t in zip(result.logprobs, result.token_ids)]
    return {"text": engine.tokenizer.decode(result.token_ids, skip_special_tokens=skip),
            "output_ids": list(result.token_ids), "meta_info": meta}


def server_info(engine: LocalEngine) -> dict[str, Any]:
    """The ``/get_server_info`` fields the client reads."""
    return {"enable_deterministic_inference": engine.deterministic, "attention_backend": "torch_sdpa",
            "weight_version": str(engine.policy_version), "version": "osvl-loopback"}


def _handler(engine: LocalEngine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _send(self, status: int, body: dict | None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, None)
            elif self.path == "/get_server_info":
                self._send(200, server_info(engine))
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError as error:
                return self._send(400, {"error": {"message": f"invalid JSON: {error}"}})
            if self.path == "/generate":
                self._generate(body)
            elif self.path == "/update_weights_from_disk":
                self._update_weights(body)
            else:
                self._send(404, {"error": {"message": f"unknown path {self.path}"}})

        def _generate(self, body: Any) -> None:
            try:
                request = request_from_json(body, engine)
                result = engine.generate_batch([request])[0]
            except (ValueError, TypeError, OSError, RuntimeError) as error:
                return self._send(400, {"error": {"message": str(error)}})
            self._send(200, response_json(result, request, body, engine, body.get("rid") or uuid.uuid4().hex))

        def _update_weights(self, body: Any) -> None:
            try:
                state = torch.load(body["model_path"], map_location="cpu", weights_only=True)
                version = body.get("weight_version")
                engine.load_weights(state, engine.policy_version + 1 if version is None else int(version))
            except (ValueError, KeyError, TypeError, OSError, RuntimeError) as error:
                return self._send(400, {"success": False, "message": f"failed to load weights: {error!r}",
                                        "num_paused_requests": 0})
            self._send(200, {"success": True, "message": f"loaded; weight version {engine.policy_version}",
                             "num_paused_requests": 0})
    return Handler


class LoopbackServer:
    """``with LoopbackServer(engine) as server: server.url``; one thread per connection."""

    def __init__(self, engine: LocalEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.httpd = ThreadingHTTPServer((host, port), _handler(engine))
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="osvl-sglang-loopback")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
