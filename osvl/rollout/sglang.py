"""Client for SGLang servers' native ``/generate`` API: one or many servers (or an sglang-router URL).

Requests carry the exact context ids and the already-resized images (PNG, base64 data URLs), ask
for ``return_logprob`` and read ``meta_info.output_token_logprobs`` (``[logprob, id, text]`` per
generated token). Transport failures and aborted requests raise ``EngineError`` (infra), never
a policy error. Weights are updated with ``/update_weights_from_disk`` on every server.

Wire format, checked field by field against sgl-project/sglang and driven against a real SGLang
0.5.23 server and sglang-router 0.3.2 (``tests/rollout/test_real_sglang.py``); sources are under
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
``/pause_generation``           ``mode`` ``abort``: aborts every running request until none runs,   hs tm
                                holds new ones; answers ``status: ok``
``/continue_generation``        releases the held requests                                         hs tm
==============================  ==================================================================  =====

Facts the contract relies on:

- A request aborted by ``/pause_generation`` answers ``finish_reason {type: abort}`` with the ids
  and logprobs it produced so far; a request that arrives while paused waits at the server until
  ``/continue_generation`` [tm ``generate_request``, ``pause_generation``]. Asynchronous GRPO
  pauses around every weight update, so no request runs on half-updated weights, and the
  client continues each aborted request from its tokens (as AReaL's and verl's fully-async
  rollouts do) or restarts the rollout (``partial_rollouts``). The server's stop-string check
  sees only the continuation's output, so the client looks for a stop string across the seam.

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
- sglang-router routes ``/generate`` to one worker and has no weight-update, pause or version
  routes (unmatched paths are 404): the trainer sends weight updates to every worker itself
  (``update_urls``), as slime, AReaL and rLLM do.
- ``GET /get_model_info`` answers ``model_path``, ``tokenizer_path``, ``is_generation``,
  ``preferred_sampling_params``, ``weight_version``; ``GET /get_server_info`` the server args
  (``tp_size``, ``context_length``, ``enable_deterministic_inference``...) [hs].
- ``/init_weights_update_group`` takes ``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``group_name``, ``backend``; the server's ranks are ``rank_offset + tp_rank``
  and receive broadcasts from rank 0, the trainer; its store keys carry three prefixes
  (:func:`osvl.rollout.weight_sync.update_group_store`). ``/update_weights_from_distributed`` takes
  ``names``, ``dtypes``, ``shapes``, ``group_name``, ``flush_cache``, ``weight_version`` and
  blocks until the broadcasts arrive, so it is sent first and the tensors broadcast after, in
  the same order [io hs]. SGLang 0.5.23 refuses it (400) outside a session opened by
  ``/begin_weight_update`` (``selector`` "all") and closed by ``/end_weight_update``.
- ``/get_model_info`` reports ``weight_version`` "default" until an update sets one; there is no
  ``/get_weight_version`` route (404). An unknown route answers 404 ``{"detail": "Not Found"}``.
- A server that restarts (a crash, an OOM, a supervisor bringing it back) loses the trainer's
  weights: it serves its launch checkpoint and reports its launch ``weight_version``. A server this
  client has reached before and that now refuses or drops requests is waited for (up to
  ``SGLangConfig.reconnect_s``); generation to it waits meanwhile, and once it answers, every weight
  server that reports another version than the trainer's loads the last weights the trainer synced
  from disk (``/update_weights_from_disk`` with their path and version) before any request goes on;
  the request that was dropped is sent again. With distributed weight sync there is no such copy:
  the request fails naming the server and what to do (relaunch the trainer, which resumes from its
  newest checkpoint and pushes its weights first).
- Deterministic inference (results independent of batch composition) is a server launch flag,
  ``--enable-deterministic-inference`` (batch-invariant kernels; FlashInfer, FA3 or Triton
  attention), not a request field; with temperature > 0 it also needs each request's
  ``sampling_seed``. A client learns whether a server runs it only from ``/get_server_info``, so with
  ``SGLangConfig.deterministic`` the pre-flight (``check_deterministic_inference``) refuses a server
  that does not, and a request without a seed is refused.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from osvl.rollout.engine import (
    EngineError,
    GenerationPreempted,
    GenerationRequest,
    GenerationResult,
    StopKind,
    hits_stop,
)
from osvl.rollout.server_admin import FleetConfig, ServerFleet

log = logging.getLogger(__name__)
GONE = (httpx.NetworkError, httpx.RemoteProtocolError)  # refused, reset, or dropped mid-request: the server died
RECONNECT_POLL_S = 1.0  # how often a server that went away is asked whether it is back


DETERMINISTIC_FLAG = "--enable-deterministic-inference"  # the SGLang server flag rollout.deterministic needs
PartialRollouts = Literal["keep", "restart"]
MAX_IDLE_ABORTS = 8  # aborts in a row that return no token before a request counts as failed


@dataclass(frozen=True)
class SGLangConfig(FleetConfig):
    """``urls``: server base URLs, or one sglang-router URL (then ``update_urls`` names the servers)."""

    deterministic: bool = False  # recipe rollout.deterministic: servers must run DETERMINISTIC_FLAG
    partial_rollouts: PartialRollouts = "keep"  # an aborted request: continue it (keep its tokens), or restart
    reconnect_s: float = 600.0  # how long a server reached before may be gone (restarting) before requests fail

    def __post_init__(self) -> None:
        if self.partial_rollouts not in ("keep", "restart"):
            raise ValueError(f"unknown partial_rollouts {self.partial_rollouts!r}; expected keep or restart")
        if not self.reconnect_s > 0:
            raise ValueError(f"reconnect_s must be positive, got {self.reconnect_s}")
        super().__post_init__()


def image_data_url(pixels) -> str:
    import cv2  # only where an image is sent: the rest of the client runs without OpenCV

    ok, png = cv2.imencode(".png", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR))
    if not ok:
        raise ValueError(f"cannot PNG-encode image of shape {pixels.shape}")
    return "data:image/png;base64," + base64.b64encode(png.tobytes()).decode()


def generate_payload(request: GenerationRequest) -> dict[str, Any]:
    s = request.sampling
    sampling = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_new_tokens": s.max_new_tokens,
        "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if s.seed is not None:
        sampling["sampling_seed"] = s.seed
    payload: dict[str, Any] = {
        "input_ids": list(request.input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_text_in_logprobs": False,
    }
    if request.images:
        payload["image_data"] = [image_data_url(image.pixels) for image in request.images]
    return payload


def parse_generate_response(body: Any, policy_version: int, *, allow_abort: bool = False) -> GenerationResult:
    """``GenerationResult`` from a ``/generate`` JSON body; malformed bodies are infra errors. The
    tokens' policy version is the server's ``meta_info.weight_version`` when it is a number (osvl
    sets it with every update), else ``policy_version``, the client's. An aborted request is an infra
    error unless ``allow_abort``: then it is a ``StopKind.ABORT`` result with the tokens it got."""
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
    if kind not in ("stop", "length") and not (allow_abort and kind == "abort"):
        raise EngineError(f"generation ended with finish_reason {finish!r}")
    served = str(meta.get("weight_version", ""))
    version = int(served) if served.isdigit() else policy_version  # the server's word when it reports one
    return GenerationResult(ids, logprobs, StopKind(kind), version, int(meta.get("prompt_tokens", 0)))


def continuation(request: GenerationRequest, generated: Sequence[int]) -> GenerationRequest:
    """The request that goes on from ``generated``, the tokens an aborted request already produced."""
    s = request.sampling
    return GenerationRequest(
        [*request.input_ids, *generated],
        request.images,
        dataclasses.replace(s, max_new_tokens=s.max_new_tokens - len(generated)),
    )


def first_stop_across(ids: Sequence[int], boundary: int, decode, sampling) -> int | None:
    """Length of the output up to a stop string that straddles ``boundary`` (where an aborted
    request was continued: the server's stop check never saw both sides), else None."""
    if decode is None or not sampling.stop:
        return None
    window = max(len(stop) for stop in sampling.stop) + 2
    for end in range(boundary + 1, min(boundary + window, len(ids)) + 1):
        if hits_stop(ids[:end], decode, sampling.stop, ()):
            return end
    return None


def _refusal(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)[:300]
    return str(body)[:300]


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


@dataclass
class _Recovery:
    """A server's return under way: generation to it waits for ``done``; ``failure`` says why it did not."""

    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    failure: str | None = None


class SGLangEngine(ServerFleet):
    """The ``Engine`` protocol over SGLang servers, and the servers' weight-update and info routes.

    Every failure names the server it came from; a weight update counts only when every server
    reports the new version afterwards (never assumed from a 200). A server that went away and came
    back is given the trainer's weights before it generates again (see the module's notes)."""

    kind = "SGLang"
    version_route = "/get_model_info"

    config: SGLangConfig

    def __init__(
        self,
        config: SGLangConfig,
        client: httpx.AsyncClient | None = None,
        policy_version: int = 0,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        super().__init__(config, client, policy_version)
        self.decode = decode  # the tokenizer's, to find a stop string split by a continued abort
        self._reached: set[str] = set()  # servers that answered once: one that goes away later is restarting
        self._recovering: dict[str, _Recovery] = {}
        self._disk_weights: tuple[str, int] | None = None  # the last synced weights on disk, and their version
        self.restarts = 0  # servers that went away and came back (a restart each), since take_restarts

    async def take_restarts(self) -> int:
        """Servers seen going away and coming back since the last call (a restart each); on the engine's loop."""
        taken, self.restarts = self.restarts, 0
        return taken

    def for_server(self, url: str) -> SGLangEngine:
        """This client aimed at one server (pre-flight probes each), sharing the connection pool."""
        return SGLangEngine(SGLangConfig((url,), timeout_s=self.config.timeout_s), self.client, self._version)

    async def _generate_once(self, request: GenerationRequest) -> GenerationResult:
        server = self._pick()
        self.in_flight[server] += 1
        try:
            response, version = await self._post_generate(self.config.urls[server], generate_payload(request))
        finally:
            self.in_flight[server] -= 1
        if response.status_code != 200:
            raise EngineError(
                f"SGLang /generate on {self.config.urls[server]} returned HTTP {response.status_code}: "
                f"{_refusal(response)}"
            )
        return parse_generate_response(response.json(), version, allow_abort=True)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """One generation. A request aborted by a pause for a weight update is continued from the
        tokens it got (``partial_rollouts = "keep"``: each keeps its logprob and the version that
        produced it; the continuation waits at the paused server and runs on the new weights) or
        raises ``GenerationPreempted`` (``"restart"``)."""
        s = request.sampling
        if self.config.deterministic and s.temperature > 0 and s.seed is None:
            raise ValueError("deterministic rollouts sample with a per-request seed (sampling_seed); got none")
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        idle_aborts, prompt_tokens = 0, 0
        while True:
            part = await self._generate_once(continuation(request, ids) if ids else request)
            prompt_tokens = prompt_tokens or part.prompt_tokens
            boundary = len(ids)
            ids += part.token_ids
            logprobs += part.logprobs
            versions += [part.policy_version] * len(part.token_ids)
            if boundary and (end := first_stop_across(ids, boundary, self.decode, request.sampling)) is not None:
                del ids[end:], logprobs[end:], versions[end:]
                finish = StopKind.STOP
                break
            finish = part.finish
            if finish is not StopKind.ABORT:
                break
            if self.config.partial_rollouts == "restart":
                raise GenerationPreempted(f"generation aborted after {len(ids)} tokens (a weight update)")
            idle_aborts = 0 if part.token_ids else idle_aborts + 1
            if idle_aborts >= MAX_IDLE_ABORTS:
                raise EngineError(f"generation aborted {idle_aborts} times in a row without a token")
            if len(ids) >= request.sampling.max_new_tokens:
                finish = StopKind.LENGTH
                break
        first = versions[0] if versions else part.policy_version
        mixed = len(set(versions)) > 1
        return GenerationResult(ids, logprobs, finish, first, prompt_tokens, list(versions) if mixed else None)

    async def _post_generate(self, url: str, payload: dict[str, Any]) -> tuple[httpx.Response, int]:
        """``/generate`` on ``url`` and the policy version it was sent under; a server reached before that
        refuses or drops it is waited for and given the trainer's weights, and the request sent again."""
        while True:
            recovery = self._recovering.get(url)
            if recovery is not None:
                await self._await_recovery(recovery)
            version = self._version
            try:
                response = await self.client.post(f"{url}/generate", json=payload)
            except GONE as error:
                if url not in self._reached:
                    raise EngineError(f"SGLang server {url} unreachable: {error!r}") from None
                await self._recover(url, error)
                continue
            except httpx.HTTPError as error:
                raise EngineError(f"SGLang server {url} unreachable: {error!r}") from None
            self._reached.add(url)
            return response, version

    async def _await_recovery(self, recovery: _Recovery) -> None:
        await recovery.done.wait()
        if recovery.failure is not None:
            raise EngineError(recovery.failure)

    async def _recover(self, url: str, error: Exception) -> None:
        """Wait until ``url`` answers again, then make every weight server serve the trainer's weights;
        one recovery per server at a time (other requests wait for it)."""
        recovery = self._recovering.get(url)
        if recovery is not None:
            await self._await_recovery(recovery)
            return
        recovery = self._recovering[url] = _Recovery()
        try:
            await self._wait_back(url, error)
            await self.restore_weights()
        except EngineError as failure:
            recovery.failure = str(failure)
            raise
        finally:
            del self._recovering[url]
            recovery.done.set()

    async def _wait_back(self, url: str, error: Exception) -> None:
        log.warning("SGLang server %s went away (%r); waiting up to %gs for it", url, error, self.config.reconnect_s)
        gone = time.monotonic()
        while True:
            try:
                if (await self.client.get(f"{url}/get_model_info", timeout=30)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - gone > self.config.reconnect_s:
                raise EngineError(
                    f"SGLang server {url} went away ({error!r}) and has not answered for "
                    f"{self.config.reconnect_s:g}s (rollout.server_reconnect_s): restart it, then relaunch the trainer"
                )
            await asyncio.sleep(RECONNECT_POLL_S)
        self.restarts += 1
        log.warning("SGLang server %s is back after %.1fs", url, time.monotonic() - gone)

    async def lost_servers(self) -> dict[str, str]:
        """The weight servers that report another weight version than the trainer's (restarted ones), with
        the version each reports."""
        urls = self.config.weight_urls
        infos = await asyncio.gather(*(self.get_json(url, "/get_model_info") for url in urls))
        expected = str(self._version)
        return {
            url: str(info.get("weight_version"))
            for url, info in zip(urls, infos)
            if str(info.get("weight_version")) != expected
        }

    async def restore_weights(self) -> None:
        """Every weight server that lost the trainer's weights (a restart) loads the last ones synced from disk;
        ``EngineError`` naming them and what to do when there are none on disk (distributed sync)."""
        lost = await self.lost_servers()
        if not lost:
            return
        reports = "; ".join(f"{url} reports {version!r}" for url, version in lost.items())
        if self._disk_weights is None or self._disk_weights[1] != self._version:
            raise EngineError(
                f"restarted SGLang server(s) lost the trainer's weights (version {self._version}): {reports}. "
                f"Only weights synced from disk (rollout.weight_sync = 'disk') can be given back outside a step: "
                f"relaunch the trainer, which resumes from its newest checkpoint and pushes its weights first"
            )
        path, version = self._disk_weights
        body = {"model_path": path, "weight_version": str(version)}
        await self._post_all(
            "/update_weights_from_disk",
            [body] * len(lost),
            f"restoring weight version {version} from {path} after a restart",
            urls=list(lost),
        )
        still = await self.lost_servers()
        if still:
            raise EngineError(
                f"restarted SGLang server(s) still lack the trainer's weights (version {version}) after loading "
                f"{path}: " + "; ".join(f"{url} reports {v!r}" for url, v in still.items())
            )
        log.warning("restored weight version %s on %s from %s", version, ", ".join(lost), path)

    async def _send(
        self, method: str, url: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> httpx.Response:
        """One request; a server reached before that refuses or drops it is asked again every
        ``RECONNECT_POLL_S`` until it answers or ``reconnect_s`` passed (a restart)."""
        gone = None
        while True:
            try:
                response = await self.client.request(
                    method, f"{url}{path}", json=body, timeout=timeout_s or self.config.timeout_s
                )
            except GONE:
                if url not in self._reached:
                    raise
                now = time.monotonic()
                gone = gone or now
                if now - gone > self.config.reconnect_s:
                    raise
                await asyncio.sleep(RECONNECT_POLL_S)
                continue
            self._reached.add(url)
            if gone is not None:
                self.restarts += 1
                log.warning("SGLang server %s is back after %.1fs", url, time.monotonic() - gone)
            return response

    async def pause_generation(self) -> None:
        """Every weight server aborts its requests in flight and holds new ones (``/pause_generation``,
        mode ``abort``) until ``continue_generation``: no request runs while the weights change."""
        await self._post_all(
            "/pause_generation", [{"mode": "abort"}] * len(self.config.weight_urls), "pausing generation"
        )

    async def continue_generation(self) -> None:
        await self._post_all("/continue_generation", [{}] * len(self.config.weight_urls), "continuing generation")

    async def _get(self, url: str, path: str, timeout_s: float | None) -> httpx.Response:
        return await self._send("GET", url, path, timeout_s=timeout_s)

    async def _post_all(
        self, path: str, bodies: Sequence[dict[str, Any]], what: str, urls: Sequence[str] | None = None
    ) -> None:
        """POST one body per server, concurrently; every refusal is an ``EngineError`` naming its server."""
        urls = list(urls or self.config.weight_urls)

        async def post(url: str, body: dict[str, Any]) -> str | None:
            try:
                response = await self._send("POST", url, path, body)
            except httpx.HTTPError as error:
                return f"{url}: {error!r}"
            try:  # weight routes answer success, pause/continue answer status "ok"
                answer = response.json()
                ok = response.status_code == 200 and (answer.get("success") is True or answer.get("status") == "ok")
            except (ValueError, AttributeError):
                ok = False
            return None if ok else f"{url}: HTTP {response.status_code}: {_refusal(response)}"

        failures = [f for f in await asyncio.gather(*(post(u, b) for u, b in zip(urls, bodies))) if f]
        if failures:
            raise EngineError(f"{what} refused by {len(failures)} of {len(urls)} server(s): " + "; ".join(failures))

    async def check_deterministic_inference(self) -> list[ServerDeterminism]:
        """Pre-flight: what every server reports; with ``config.deterministic`` a server that does not run
        deterministic inference (or cannot say) is an error naming it and the flag it needs."""
        report = [
            server_determinism(url, await self.get_json(url, "/get_server_info", timeout_s=30))
            for url in dict.fromkeys((*self.config.urls, *self.config.weight_urls))
        ]
        missing = [r for r in report if r.enabled is not True]
        if self.config.deterministic and missing:
            raise EngineError(
                "rollout.deterministic needs every SGLang server launched with "
                f"{DETERMINISTIC_FLAG}; " + "; ".join(r.describe() for r in missing)
            )
        return report

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Every weight server loads the HF directory ``model_path``; the version changes only if all did."""
        body = {"model_path": model_path, "weight_version": str(version)}
        await self._post_all(
            "/update_weights_from_disk",
            [body] * len(self.config.weight_urls),
            f"weight update to version {version} from {model_path}",
        )
        await self.confirm_version(version)
        self._disk_weights = (model_path, version)

    async def server_ranks(self) -> list[int]:
        """Each weight server's tensor-parallel size: its ranks in a weights-update group."""
        infos = await asyncio.gather(*(self.get_json(url, "/get_server_info") for url in self.config.weight_urls))
        return [int(info.get("tp_size") or 1) for info in infos]

    async def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, sizes: Sequence[int]
    ) -> None:
        """Every weight server joins the group (trainer = rank 0; server i starts at 1 + its predecessors' sizes)."""
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        bodies = [
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset,
                "world_size": 1 + sum(sizes),
                "group_name": group_name,
                "backend": backend,
            }
            for offset in offsets
        ]
        await self._post_all("/init_weights_update_group", bodies, f"joining weights update group {group_name}")

    async def begin_weight_update(self) -> None:
        """Opens the weight-update session SGLang (0.5.23) requires around ``/update_weights_from_distributed``."""
        await self._post_all(
            "/begin_weight_update", [{"selector": "all"}] * len(self.config.weight_urls), "opening a weight update"
        )

    async def end_weight_update(self) -> None:
        await self._post_all("/end_weight_update", [{}] * len(self.config.weight_urls), "closing a weight update")

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        version: int | None,
    ) -> None:
        """Announces one bucket; returns once every server has received it (broadcast it meanwhile)."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": version is not None,
        }
        if version is not None:
            body["weight_version"] = str(version)
            self._disk_weights = None  # the servers' weights from now on exist nowhere on disk
        await self._post_all(
            "/update_weights_from_distributed",
            [body] * len(self.config.weight_urls),
            f"bucket of {len(names)} tensors for group {group_name}",
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post_all(
            "/destroy_weights_update_group",
            [{"group_name": group_name}] * len(self.config.weight_urls),
            f"destroying weights update group {group_name}",
        )
