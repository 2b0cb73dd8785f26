"""A loopback server speaking SGLang's native protocol, backed by the local engine: the CPU form of
the serving topology (tests, ``tiny_grpo_services``, ``python -m osvl.serve --engine loopback``).

Routes, with the JSON shapes of SGLang 0.5.23 as a real server answers them (fields listed in
:mod:`osvl.rollout.sglang`; the differences found against a real server are in the table of
docs/inference_engines.md, and this server follows them):

- ``POST /generate``: concurrent requests are batched by the local engine; ``sampling_seed`` counts
  only on a deterministic engine, as SGLang uses it only under ``--enable-deterministic-inference``;
- ``GET /health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info`` (no
  ``/get_weight_version``: SGLang answers it 404); ``weight_version`` is "default" until set;
- ``POST /update_weights_from_disk``: an HF checkpoint directory, as SGLang loads it;
- ``POST /init_weights_update_group``, ``/begin_weight_update``, ``/update_weights_from_distributed``
  (refused outside a begin/end session, as SGLang does), ``/end_weight_update``,
  ``/destroy_weights_update_group``: the trainer's rank 0 broadcasts HF-named tensors over a
  process group the server joins on SGLang's store keys (gloo here; NCCL on GPUs);
- ``POST /get_weights_by_name``, ``/update_weight_version``, ``/flush_cache`` (plain text);
- ``POST /pause_generation`` (mode ``abort``: requests in flight end at once as aborted, with the
  tokens they have; new ones wait) and ``/continue_generation``, as SGLang's tokenizer manager does.

Unknown routes answer 404 ``{"detail": "Not Found"}``; a body without a required field answers 400 in
SGLang's validation-error shape (``object: error``).

Request fields the local engine cannot honor (prompt logprobs, top-k, penalties, ``logit_bias``,
batches) are refused with HTTP 400 rather than silently ignored. A ``script`` turns generation into
forced decoding (scripted ids, the model's own logprobs; see ``ReplayEngine``), so protocol tests
know what the policy does. ``logprobs="raw"`` makes the server report pre-temperature logprobs,
as SGLang does under ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``: the pre-flight must catch that mode.

``python -m osvl.serve.loopback_engine --model-path DIR [--port P]`` runs it as a process.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import json
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from osvl.data.image import process_image
from osvl.model.checkpoint import from_hf_state_dict, from_pretrained, to_hf_state_dict
from osvl.rollout.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
)
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.rollout.weight_sync import update_group_store
from osvl.serve.stand_in import StandInServer, serve_until_interrupted, service_parser
from osvl.tools.image_io import decode_image

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "stop",
        "stop_token_ids",
        "sampling_seed",
        "skip_special_tokens",
        "no_stop_trim",
        "spaces_between_special_tokens",
    }
)
REQUEST_KEYS = frozenset(
    {
        "input_ids",
        "image_data",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "return_text_in_logprobs",
        "rid",
        "stream",
    }
)
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
UNSET_WEIGHT_VERSION = "default"  # SGLang's --weight-version default, reported until an update sets one
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
MAX_IMAGE_PIXELS = 64_000_000  # refused before decoding: a header claiming more is a decompression bomb
MAX_IMAGE_BYTES = 64 << 20
LogprobMode = Literal["post_temperature", "raw"]


class MissingField(ValueError):
    """A body without a field SGLang requires: 400 in the shape of its request validation."""


def required(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise MissingField(f"{key}: Field required")
    return body[key]


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
        temperature=float(_or_default(s, "temperature", 1.0)),
        top_p=float(_or_default(s, "top_p", 1.0)),
        max_new_tokens=int(_or_default(s, "max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(int(i) for i in _or_default(s, "stop_token_ids", ())),
        seed=None if s.get("sampling_seed") is None else int(s["sampling_seed"]),
    )
    urls = _or_default(body, "image_data", [])
    if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
        raise ValueError("image_data must be a list of base64 strings or data URLs (one request's images)")
    images = []
    for url in urls:
        data = base64.b64decode(url.split(",", 1)[1] if url.startswith("data:") else url)
        images.append(process_image(decode_image(data, MAX_IMAGE_PIXELS, MAX_IMAGE_BYTES), engine.image_config))
    return GenerationRequest(reexpand_image_pads(ids, images, engine.tokenizer.special.image_pad), images, sampling)


def reexpand_image_pads(ids: list[int], images: Sequence, pad_id: int) -> list[int]:
    """Each run of image pads re-expanded to the pad count of the server's own processing of its
    image, as SGLang's Qwen-VL processor does: a client whose image settings differ sees another
    prompt length, never a silent mismatch between pads and pixels."""
    out, run = [], 0
    for token in [*ids, None]:
        if token == pad_id:
            run += 1
            continue
        if run:
            index = sum(1 for i, t in enumerate(out) if t == pad_id and (i == 0 or out[i - 1] != pad_id))
            if index >= len(images):
                raise ValueError(f"{index + 1} image-pad runs but {len(images)} image(s) in image_data")
            out += [pad_id] * images[index].num_tokens
            run = 0
        if token is not None:
            out.append(token)
    return out


def finish_reason(result: GenerationResult, request: GenerationRequest, engine: LocalEngine) -> dict[str, Any]:
    """SGLang's ``finish_reason``: the stop id or stop string that matched, the length reached, or an abort."""
    if result.finish is StopKind.ABORT:
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    if result.finish is StopKind.LENGTH:
        return {"type": "length", "length": len(result.token_ids)}
    last = result.token_ids[-1]
    if last in request.sampling.stop_token_ids:
        return {"type": "stop", "matched": last}
    text = engine.tokenizer.decode(result.token_ids)
    return {"type": "stop", "matched": next((s for s in request.sampling.stop if s in text), None)}


def response_json(
    result: GenerationResult,
    request: GenerationRequest,
    body: dict[str, Any],
    engine: LocalEngine,
    rid: str,
    weight_version: str | None = None,
    latency_s: float = 0.0,
) -> dict[str, Any]:
    skip = _or_default(_or_default(body, "sampling_params", {}), "skip_special_tokens", True)
    version = str(result.policy_version) if weight_version is None else weight_version
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason(result, request, engine),
        "prompt_tokens": result.prompt_tokens,
        "weight_version": version,
        "num_retractions": 0,
        "completion_tokens": len(result.token_ids),
        "cached_tokens": 0,
        "weight_versions": [{"version": version, "start": 0, "end": len(result.token_ids)}],
        "e2e_latency": latency_s,
    }
    if body.get("return_logprob"):
        with_text = bool(body.get("return_text_in_logprobs"))
        meta["input_token_logprobs"] = []  # logprob_start_len -1: none of the prompt's
        meta["output_token_logprobs"] = [
            [lp, t, engine.tokenizer.decode([t]) if with_text else None]
            for lp, t in zip(result.logprobs, result.token_ids)
        ]
    return {
        "text": engine.tokenizer.decode(result.token_ids, skip_special_tokens=skip),
        "output_ids": list(result.token_ids),
        "meta_info": meta,
    }


class _UpdateGroup:
    """The server's end of a weights-update group: receives the trainer's broadcasts (root 0)."""

    def __init__(self, body: dict[str, Any]) -> None:
        backend = body.get("backend") or "gloo"
        if backend != "gloo":
            raise ValueError(f"the loopback server joins gloo update groups only, got backend {backend!r}")
        rank, size = int(required(body, "rank_offset")), int(required(body, "world_size"))
        if not 0 < rank < size:
            raise ValueError(f"rank_offset {rank} must lie in [1, world_size {size}) (the trainer is rank 0)")
        store = dist.TCPStore(
            str(required(body, "master_address")),
            int(required(body, "master_port")),
            size,
            is_master=False,
            timeout=datetime.timedelta(seconds=120),
        )
        self.name = str(required(body, "group_name"))
        self.group = dist.ProcessGroupGloo(
            update_group_store(store, self.name, backend), rank, size, datetime.timedelta(seconds=600)
        )

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        out = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, str(dtype).removeprefix("torch.")))
            self.group.broadcast([tensor]).wait()
            out[name] = tensor
        return out


_ENGINE_LOOPS: weakref.WeakKeyDictionary[LocalEngine, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()
_ENGINE_LOOPS_LOCK = threading.Lock()


def _engine_loop(engine: LocalEngine) -> asyncio.AbstractEventLoop:
    """One event loop per engine, shared by every server in front of it: the engine batches the
    requests queued on its loop, so all of them must reach the same one."""
    with _ENGINE_LOOPS_LOCK:
        loop = _ENGINE_LOOPS.get(engine)
        if loop is None:
            loop = _ENGINE_LOOPS[engine] = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="osvl-loopback-engine").start()
        return loop


class LoopbackServer(StandInServer):
    """``with LoopbackServer(engine) as server: server.url``; one thread per connection, generation
    batched by the engine on its event loop."""

    def __init__(
        self,
        engine: LocalEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        model_path: str = "",
        tokenizer_path: str = "",
        logprobs: LogprobMode = "post_temperature",
        script: Callable[[GenerationRequest], Sequence[int]] | None = None,
        weight_version: str = UNSET_WEIGHT_VERSION,
    ) -> None:
        if logprobs not in ("post_temperature", "raw"):
            raise ValueError(f"logprobs must be 'post_temperature' or 'raw', got {logprobs!r}")
        self.engine, self.model_path, self.tokenizer_path, self.logprobs = engine, model_path, tokenizer_path, logprobs
        self.replay = ReplayEngine(engine, script) if script is not None else None  # forced decoding (tests)
        self.weight_version = weight_version
        self._groups: dict[str, _UpdateGroup] = {}
        self._weight_session = False  # between /begin_weight_update and /end_weight_update
        self._staged: dict[str, torch.Tensor] = {}  # HF tensors of an update whose experts are incomplete
        self._gate = threading.Condition()  # /pause_generation: new requests wait, running ones are counted
        self._paused = False
        self._running = 0
        super().__init__(_handler(self), host, port, "osvl-sglang-loopback")
        self.url = f"http://{host}:{self.httpd.server_address[1]}"

    # --- routes ---------------------------------------------------------------------------------

    def generate(self, body: Any) -> dict[str, Any]:
        start = time.perf_counter()
        request = request_from_json(body, self.engine)
        with self._gate:
            while self._paused:
                self._gate.wait()
            self._running += 1
        try:
            if self.replay is not None:
                result = self.replay.replay(request)
            else:
                result = asyncio.run_coroutine_threadsafe(
                    self.engine.generate(self._as_sampled(request)), _engine_loop(self.engine)
                ).result()
        finally:
            with self._gate:
                self._running -= 1
                self._gate.notify_all()
        if self.logprobs == "raw" and result.token_ids:
            result.logprobs = self.engine.score(request, result.token_ids, temperature=1.0)
        return response_json(
            result,
            request,
            body,
            self.engine,
            body.get("rid") or uuid.uuid4().hex,
            self.weight_version,
            time.perf_counter() - start,
        )

    def _as_sampled(self, request: GenerationRequest) -> GenerationRequest:
        """The request without its seed unless the engine is deterministic: SGLang uses ``sampling_seed``
        only under ``--enable-deterministic-inference``. A script (forced decoding) still reads the seed."""
        if self.engine.deterministic or request.sampling.seed is None:
            return request
        return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=None))

    def pause(self, body: dict[str, Any]) -> dict[str, Any]:
        """Aborts the requests in flight (they answer with the tokens they have) and holds new ones;
        returns once none runs."""
        mode = body.get("mode") or "abort"
        if mode != "abort":
            raise ValueError(f"pause mode {mode!r} is not supported by the loopback server (abort only)")
        with self._gate:
            self._paused = True
            self.engine.abort()
            while self._running:
                self._gate.wait()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._gate:
            self._paused = False
            self.engine.resume()
            self._gate.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def model_info(self) -> dict[str, Any]:
        moe = self.engine.model.arch.text.is_moe
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": True,
            "model_type": "qwen3_vl_moe" if moe else "qwen3_vl",
            "architectures": ["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
        }

    def server_info(self) -> dict[str, Any]:
        image = self.engine.image_config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "skip_tokenizer_init": False,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": None,
            "enable_deterministic_inference": self.engine.deterministic,
            "attention_backend": "torch_sdpa",
            "weight_version": self.weight_version,
            "version": "osvl-loopback",
            "mm_process_config": {"image": {"min_pixels": image.min_pixels, "max_pixels": image.max_pixels}},
            "max_running_requests": self.engine.max_batch,
        }

    def _load_hf(self, tensors: dict[str, torch.Tensor], version: str | None) -> None:
        """Loads the HF-named tensors that convert on their own; a layer's experts wait for both halves."""
        self._staged.update(tensors)
        ready = {k: t for k, t in self._staged.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        for key in [k for k in self._staged if k.endswith("experts.gate_up_proj")]:
            down = key.removesuffix("gate_up_proj") + "down_proj"
            if down in self._staged:
                ready[key], ready[down] = self._staged[key], self._staged[down]
        state = from_hf_state_dict(ready, self.engine.model.arch)
        dtype = next(self.engine.model.parameters()).dtype
        self.engine.load_weights(
            {k: t.to(dtype) for k, t in state.items()},
            self.engine.policy_version if version is None else int(version),
            partial=True,
        )
        for key in ready:
            del self._staged[key]
        if version is not None:
            self.weight_version = version

    def update_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        path = Path(str(required(body, "model_path")))
        version = body.get("weight_version")
        dtype = next(self.engine.model.parameters()).dtype
        loaded = from_pretrained(path, dtype=dtype)
        if loaded.arch != self.engine.model.arch:
            raise ValueError(f"{path} holds another architecture than the served model")
        self._staged.clear()
        self.engine.load_weights(
            loaded.state_dict(), int(version) if version is not None else self.engine.policy_version + 1
        )
        self.weight_version = str(version) if version is not None else str(self.engine.policy_version)
        self.model_path = str(path)
        return {
            "success": True,
            "message": f"loaded {path}. Weight version updated to {self.weight_version}.",
            "num_paused_requests": 0,
        }

    def begin_weight_update(self, body: dict[str, Any]) -> dict[str, Any]:
        if self._weight_session:
            raise ValueError("a weight-update session is already open; call end_weight_update() first")
        self._weight_session = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self._weight_session:
            raise ValueError("no weight-update session is open; call begin_weight_update() first")
        self._weight_session = False
        return {"success": True, "message": "Success"}

    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        group = _UpdateGroup(body)
        self._groups[group.name] = group
        return {"success": True, "message": f"joined weights update group {group.name}"}

    def update_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self._weight_session:
            raise ValueError(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        name = str(body.get("group_name", ""))
        if name not in self._groups:
            raise ValueError(f"no weights update group {name!r}; call /init_weights_update_group first")
        if body.get("load_format") not in (None, "direct"):
            raise ValueError(f"load_format {body.get('load_format')!r} is not supported by the loopback server")
        tensors = self._groups[name].receive(
            list(required(body, "names")), list(required(body, "dtypes")), list(required(body, "shapes"))
        )
        version = body.get("weight_version")
        self._load_hf(tensors, None if version is None else str(version))
        return {"success": True, "message": f"received {len(tensors)} tensors"}

    def destroy_group(self, body: dict[str, Any]) -> dict[str, Any]:
        group = self._groups.pop(str(body.get("group_name", "")), None)
        return {"success": group is not None, "message": "destroyed" if group else "no such group"}

    def weights_by_name(self, body: dict[str, Any]) -> list[Any]:
        state = to_hf_state_dict(self.engine.model.state_dict(), self.engine.model.arch)
        name = str(body.get("name", ""))
        if name not in state:
            raise ValueError(f"no parameter named {name!r}")
        limit = int(body.get("truncate_size", 100))
        return state[name].float().flatten()[:limit].tolist()


NOT_FOUND = {"detail": "Not Found"}  # FastAPI's answer to an unknown route


def _handler(server: LoopbackServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _send(self, status: int, body: Any) -> None:
            content_type = "application/json"
            if body is None:
                data = b""
            elif isinstance(body, str):
                data, content_type = body.encode(), "text/plain; charset=utf-8"
            else:
                data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on the request (a restart)
                pass

        def do_GET(self) -> None:
            routes = {
                "/health": lambda: None,
                "/health_generate": lambda: None,
                "/get_model_info": server.model_info,
                "/get_server_info": server.server_info,
            }
            route = routes.get(self.path)
            self._send(200, route()) if route else self._send(404, NOT_FOUND)

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except ValueError as error:
                return self._send(400, {"error": {"message": f"invalid JSON: {error}"}})
            weight_routes = {
                "/update_weights_from_disk": server.update_from_disk,
                "/init_weights_update_group": server.init_group,
                "/begin_weight_update": server.begin_weight_update,
                "/update_weights_from_distributed": server.update_from_distributed,
                "/end_weight_update": server.end_weight_update,
                "/destroy_weights_update_group": server.destroy_group,
            }
            try:
                if self.path == "/generate":
                    return self._send(200, server.generate(body))
                if self.path in weight_routes:
                    return self._send(200, weight_routes[self.path](body))
                if self.path == "/get_weights_by_name":
                    return self._send(200, server.weights_by_name(body))
                if self.path == "/pause_generation":
                    return self._send(200, server.pause(body))
                if self.path == "/continue_generation":
                    return self._send(200, server.resume(body))
                if self.path == "/update_weight_version":
                    server.weight_version = str(required(body, "new_version"))
                    return self._send(
                        200,
                        {
                            "success": True,
                            "message": f"Weight version updated to {server.weight_version}",
                            "new_version": server.weight_version,
                        },
                    )
                if self.path == "/flush_cache":
                    return self._send(200, FLUSH_CACHE_TEXT)
            except MissingField as missing:
                return self._send(
                    400, {"object": "error", "message": str(missing), "type": "Bad Request", "param": None, "code": 400}
                )
            except (ValueError, KeyError, TypeError, OSError, RuntimeError) as error:
                if self.path in weight_routes:
                    return self._send(
                        400, {"success": False, "message": f"{type(error).__name__}: {error}", "num_paused_requests": 0}
                    )
                return self._send(400, {"error": {"message": str(error)}})
            self._send(404, NOT_FOUND)

    return Handler


def engine_from_checkpoint(
    model_path: str | Path, tokenizer_path: str | Path | None = None, *, max_batch: int = 8
) -> LocalEngine:
    """A local engine over an HF checkpoint directory with its tokenizer and image settings."""
    from osvl.data.formats import checkpoint_image_config
    from osvl.data.tokenizer import load_tokenizer

    model_path = Path(model_path)
    image_config = checkpoint_image_config(model_path)
    if image_config is None:
        raise ValueError(f"{model_path} has no preprocessor_config.json: the server would not know its image settings")
    return LocalEngine(
        from_pretrained(model_path, dtype=torch.float32),
        load_tokenizer(tokenizer_path or model_path),
        image_config,
        max_batch=max_batch,
    )


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("python -m osvl.serve.loopback_engine", __doc__.splitlines()[0], 30000, "the server URL")
    parser.add_argument("--model-path", required=True, help="HF checkpoint directory (an osvl export)")
    parser.add_argument("--tokenizer-path", default="", help="tokenizer.json; default: the checkpoint's")
    parser.add_argument("--max-batch", type=int, default=8, help="rows per generation batch")
    parser.add_argument("--logprobs", choices=("post_temperature", "raw"), default="post_temperature")
    args = parser.parse_args(argv)
    try:
        engine = engine_from_checkpoint(args.model_path, args.tokenizer_path or None, max_batch=args.max_batch)
    except ValueError as error:
        parser.error(str(error))
    server = LoopbackServer(
        engine,
        args.host,
        args.port,
        model_path=str(Path(args.model_path).resolve()),
        tokenizer_path=args.tokenizer_path,
        logprobs=args.logprobs,
    )
    server.start()
    return serve_until_interrupted(server, "loopback SGLang server", server.url, args.ready_file)


if __name__ == "__main__":
    sys.exit(main())
