"""A loopback server speaking SGLang's ``/generate`` and ``/update_weights_from_disk`` protocol,
backed by the local engine: tests and the offline demo exercise the SGLang client without a GPU.

``/update_weights_from_disk`` here reads a ``torch.save``'d state dict (SGLang reads an HF
checkpoint directory); everything else follows SGLang's JSON shapes.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

import torch

from osvl.data.image import decode_image, process_image
from osvl.rollout.engine import GenerationRequest, SamplingParams
from osvl.rollout.local_engine import LocalEngine


def _request_from_json(body: dict, engine: LocalEngine) -> GenerationRequest:
    s = body.get("sampling_params", {})
    sampling = SamplingParams(temperature=float(s.get("temperature", 1.0)), top_p=float(s.get("top_p", 1.0)),
                              max_new_tokens=int(s.get("max_new_tokens", 128)), stop=tuple(s.get("stop", ())),
                              stop_token_ids=tuple(s.get("stop_token_ids", ())), seed=s.get("sampling_seed"))
    images = []
    for url in body.get("image_data", []) or []:
        data = base64.b64decode(url.split(",", 1)[1] if url.startswith("data:") else url)
        images.append(process_image(decode_image(data), engine.image_config))
    return GenerationRequest(list(body["input_ids"]), images, sampling)


def _handler(engine: LocalEngine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, {"ok": True}) if self.path == "/health" else self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path == "/generate":
                    result = engine.generate_batch([_request_from_json(body, engine)])[0]
                    self._send(200, {"output_ids": result.token_ids, "meta_info": {
                        "finish_reason": {"type": result.finish.value},
                        "prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
                        "output_token_logprobs": [[lp, t, None] for lp, t in zip(result.logprobs, result.token_ids)],
                        "weight_version": str(engine.policy_version)}})
                elif self.path == "/update_weights_from_disk":
                    state = torch.load(body["model_path"], map_location="cpu", weights_only=True)
                    engine.load_weights(state, int(body.get("weight_version", engine.policy_version + 1)))
                    self._send(200, {"success": True, "message": "loaded"})
                else:
                    self._send(404, {"error": f"unknown path {self.path}"})
            except (ValueError, KeyError, OSError, RuntimeError) as error:
                self._send(400, {"success": False, "message": str(error), "error": str(error)})
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
