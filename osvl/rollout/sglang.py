"""Client for SGLang servers' native ``/generate`` API: one or many servers (or an sglang-router URL).

Requests carry the exact context ids and the already-resized images (PNG, base64 data URLs), ask
for ``return_logprob`` and read ``meta_info.output_token_logprobs`` (``[logprob, id, text]`` per
generated token). Transport failures and aborted requests raise ``EngineError`` (infra), never
a policy error. Weights are updated with ``/update_weights_from_disk`` on every server.

Wire format, checked field by field against sgl-project/sglang; sources are under
``python/sglang/srt/``: [io] ``managers/io_struct.py`` (``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``), [sp] ``sampling/sampling_params.py`` (``SamplingParams``),
[tm] ``managers/tokenizer_manager.py`` (``detokenize_logprob_tokens``), [sb]
``managers/schedule_batch.py`` (``FINISH_*.to_json``), [hs] ``entrypoints/http_server.py``.

==============================  ==================================================================  =====
field                           as used here                                                        src
==============================  ==================================================================  =====
``input_ids``                   one flat list = one request (a list of lists is a batch)            io
``image_data``                  list of data URLs = that one request's images, in pad-run order     io
``return_logprob``              true                                                                io
``logprob_start_len``           -1: logprobs of the output tokens only                              io
``return_text_in_logprobs``     false: the third entry of each triple is null                       io
``sampling_params`` keys                                                                            sp
- ``max_new_tokens``            per-turn budget (server default 128)                                sp
- ``temperature``, ``top_p``    temperature 0 is greedy (the server sets top_k = 1)                 sp
- ``stop``, ``stop_token_ids``  stop strings, stop ids (a set on the server)                        sp
- ``skip_special_tokens``       false (affects ``text`` only)                                       sp
- ``no_stop_trim``              true: the matched stop stays in the output                          sp
- ``sampling_seed``             the per-request seed (exact name)                                   sp
``output_ids``                  generated ids; must equal the ids of the logprob triples            tm
``meta_info`` keys                                                                                  tm
- ``output_token_logprobs``     ``[logprob, token_id, text | null]`` per generated token            tm
- ``finish_reason``             ``{type: stop, matched: id | str}`` or ``{type: length, length}``;  sb
                                ``{type: abort, message}`` is an infra error
- ``prompt_tokens``             context length as the server counted it                             tm
``/update_weights_from_disk``   ``model_path``, ``weight_version`` (a str); answers ``success``,    io hs
                                ``message``, ``num_paused_requests``; HTTP 400 when refused
``GET /health``                 200 with an empty body once a 1-token probe answers, else 503       hs
``GET /get_server_info``        the server's arguments as one JSON object                          hs
                                (``dataclasses.asdict(ServerArgs)``: ``enable_deterministic_inference``,
                                ``attention_backend``...), scheduler info, ``version``
==============================  ==================================================================  =====

Facts the contract relies on:

- Logprobs are ``log_softmax(logits / temperature)`` unless the server runs with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (pre-temperature): leave it unset, or engine and trainer
  logprobs disagree at T != 1. Greedy requests report T = 1, as the local engine does.
- SGLang's Qwen-VL processor matches *expanded* pad runs
  (``<|vision_start|>(<|image_pad|>)+<|vision_end|>``, ``multimodal/processors/qwen_vl.py``) and
  re-expands them from its own resize of ``image_data``: our ``ImageConfig`` must equal the
  server's processor settings, or the pad counts differ.
- ``no_stop_trim`` keeps the matched stop in the output, so ``output_ids`` and the logprob triples
  hold the same ids. The response also has ``text`` (unused: ids are never re-encoded).
- ``logit_bias`` exists, but it acts on the logits the returned logprobs come from, so they would
  drift from the trainer's; reserved vision ids are stop ids instead and the agent loop rejects
  them (:mod:`osvl.rollout.reserved`).
- Deterministic inference (results independent of batch composition) is a server launch flag,
  ``--enable-deterministic-inference`` (batch-invariant kernels; FlashInfer, FA3 or Triton
  attention), not a request field; with temperature > 0 it also needs each request's
  ``sampling_seed``. A client learns whether a server runs it only from ``/get_server_info``, so with
  ``SGLangConfig.deterministic`` the pre-flight (``check_deterministic_inference``) refuses a server
  that does not, and a request without a seed is refused.
- Behind sglang-router, ``/generate`` is routed to one worker; how it answers a weight update
  was not verified here: list the workers' URLs when the trainer syncs weights.
- Also verified but unused: ``/flush_cache`` (GET/POST), ``/get_model_info`` (``model_path``,
  ``weight_version``...), ``/update_weights_from_tensor`` and ``/update_weights_from_distributed``.
"""

from __future__ import annotations

import base64
import itertools
from dataclasses import dataclass
from typing import Any, Literal

import cv2
import httpx

from osvl.rollout.engine import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    StopKind,
)

Routing = Literal["round_robin", "least_loaded"]
DETERMINISTIC_FLAG = "--enable-deterministic-inference"  # the SGLang server flag rollout.deterministic needs


@dataclass(frozen=True)
class SGLangConfig:
    urls: tuple[str, ...]  # server base URLs, or one sglang-router URL
    routing: Routing = "least_loaded"
    timeout_s: float = 600.0
    deterministic: bool = False  # recipe rollout.deterministic: servers must run DETERMINISTIC_FLAG

    def __post_init__(self) -> None:
        if not self.urls or any(not u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"SGLangConfig.urls needs http(s) base URLs, got {self.urls!r}")
        if self.routing not in ("round_robin", "least_loaded"):
            raise ValueError(f"unknown routing {self.routing!r}; expected round_robin or least_loaded")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


def image_data_url(pixels) -> str:
    ok, png = cv2.imencode(".png", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR))
    if not ok:
        raise ValueError(f"cannot PNG-encode image of shape {pixels.shape}")
    return "data:image/png;base64," + base64.b64encode(png.tobytes()).decode()


def generate_payload(request: GenerationRequest) -> dict[str, Any]:
    s = request.sampling
    sampling = {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens,
                "stop": list(s.stop), "stop_token_ids": list(s.stop_token_ids), "skip_special_tokens": False,
                "no_stop_trim": True}
    if s.seed is not None:
        sampling["sampling_seed"] = s.seed
    payload: dict[str, Any] = {"input_ids": list(request.input_ids), "sampling_params": sampling,
                               "return_logprob": True, "logprob_start_len": -1, "return_text_in_logprobs": False}
    if request.images:
        payload["image_data"] = [image_data_url(image.pixels) for image in request.images]
    return payload


def parse_generate_response(body: Any, policy_version: int) -> GenerationResult:
    """``GenerationResult`` from a ``/generate`` JSON body; malformed bodies are infra errors."""
    try:
        meta = body["meta_info"]
        entries = meta["output_token_logprobs"]
        ids = [int(entry[1]) for entry in entries]
        logprobs = [float(entry[0]) for entry in entries]
        finish = meta["finish_reason"]
        kind = finish["type"] if isinstance(finish, dict) else finish
    except (KeyError, TypeError, IndexError, ValueError) as error:
        raise EngineError(f"malformed /generate response ({error!r}): {str(body)[:200]}") from None
    if "output_ids" in body and list(body["output_ids"]) != ids:
        raise EngineError("output_ids and output_token_logprobs disagree")
    if kind not in ("stop", "length"):
        raise EngineError(f"generation ended with finish_reason {finish!r}")
    return GenerationResult(ids, logprobs, StopKind(kind), policy_version, int(meta.get("prompt_tokens", 0)))


@dataclass(frozen=True)
class ServerDeterminism:
    """Whether one server runs deterministic inference, as its ``/get_server_info`` says."""

    url: str
    enabled: bool | None  # None: the server does not report it (an SGLang without the feature)
    attention_backend: str | None = None

    def describe(self) -> str:
        state = {True: "on", False: "off", None: "not reported"}[self.enabled]
        return f"{self.url}: deterministic inference {state} (attention backend {self.attention_backend or '?'})"


def server_determinism(url: str, info: Any) -> ServerDeterminism:
    if not isinstance(info, dict):
        raise EngineError(f"{url}/get_server_info did not answer a JSON object: {str(info)[:200]}")
    enabled = info.get("enable_deterministic_inference")
    return ServerDeterminism(url, None if enabled is None else bool(enabled), info.get("attention_backend"))


class SGLangEngine:
    def __init__(self, config: SGLangConfig, client: httpx.AsyncClient | None = None,
                 policy_version: int = 0) -> None:
        self.config = config
        self.client = client or httpx.AsyncClient(timeout=config.timeout_s)
        self._version = policy_version
        self._next = itertools.cycle(range(len(config.urls)))
        self.in_flight = [0] * len(config.urls)

    @property
    def policy_version(self) -> int:
        return self._version

    def _pick(self) -> int:
        if self.config.routing == "round_robin":
            return next(self._next)
        return min(range(len(self.in_flight)), key=lambda i: self.in_flight[i])

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        s = request.sampling
        if self.config.deterministic and s.temperature > 0 and s.seed is None:
            raise ValueError("deterministic rollouts sample with a per-request seed (sampling_seed); got none")
        server = self._pick()
        version = self._version
        self.in_flight[server] += 1
        try:
            response = await self.client.post(f"{self.config.urls[server]}/generate", json=generate_payload(request))
        except httpx.HTTPError as error:
            raise EngineError(f"SGLang server {self.config.urls[server]} unreachable: {error!r}") from None
        finally:
            self.in_flight[server] -= 1
        if response.status_code != 200:
            raise EngineError(f"SGLang /generate returned HTTP {response.status_code}: {response.text[:200]}")
        return parse_generate_response(response.json(), version)

    async def server_info(self, url: str) -> Any:
        """One server's ``/get_server_info`` body."""
        try:
            response = await self.client.get(f"{url}/get_server_info")
            body = response.json()
        except (httpx.HTTPError, ValueError) as error:
            raise EngineError(f"{url}/get_server_info failed: {error!r}") from None
        if response.status_code != 200:
            raise EngineError(f"{url}/get_server_info returned HTTP {response.status_code}: {response.text[:200]}")
        return body

    async def check_deterministic_inference(self) -> list[ServerDeterminism]:
        """Pre-flight: what every server reports; with ``config.deterministic`` a server that does not run
        deterministic inference (or cannot say) is an error naming it and the flag it needs."""
        report = [server_determinism(url, await self.server_info(url)) for url in self.config.urls]
        missing = [r for r in report if r.enabled is not True]
        if self.config.deterministic and missing:
            raise EngineError("rollout.deterministic needs every SGLang server launched with "
                              f"{DETERMINISTIC_FLAG}; " + "; ".join(r.describe() for r in missing))
        return report

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Every server loads the checkpoint at ``model_path``; the version changes only if all did."""
        for url in self.config.urls:
            try:
                response = await self.client.post(f"{url}/update_weights_from_disk",
                                                   json={"model_path": model_path, "weight_version": str(version)})
                body = response.json()
            except (httpx.HTTPError, ValueError) as error:
                raise EngineError(f"weight update on {url} failed: {error!r}") from None
            if response.status_code != 200 or not body.get("success", False):
                raise EngineError(f"weight update on {url} refused: {body.get('message', response.text[:200])}")
        self._version = version

    async def aclose(self) -> None:
        await self.client.aclose()
