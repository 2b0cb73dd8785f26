"""Client for vLLM servers: token ids in, token ids and logprobs out, and vLLM's RL weight-update API.

Checked against vLLM 0.32's source (``vllm/entrypoints/...``); the server runs with
``VLLM_SERVER_DEV_MODE=1`` (the RL and ``/collective_rpc`` routes) and ``--enable-scale-out``
(the token-in/token-out route), see ``python -m osvl.serve --engine vllm``.

==============================  ==================================================================
route / field                   as used here
==============================  ==================================================================
``POST /inference/v1/generate`` ``token_ids`` (the exact context, each image's pad run collapsed to
                                one ``<|image_pad|>``), ``sampling_params`` (vLLM's own
                                ``SamplingParams``), ``content_parts`` ``[{type: image_url, url}]``
                                for images (PNG data URLs, in pad-run order)
- ``logprobs``: 0               the sampled token's logprob only
- ``ignore_eos``: true          only the request's stop ids/strings end a turn (as every osvl engine)
- ``include_stop_str_in_output`` the matched stop stays in the output; ``token_ids`` keep every
                                generated token anyway
- ``detokenize``                on only when stop strings are asked for (the server then needs its
                                tokenizer: no ``--skip-tokenizer-init``)
- ``seed``                      the per-request seed
``choices[0]``                  ``token_ids``, ``logprobs.content[i].{token_id, logprob}``,
                                ``finish_reason`` (``stop``/``length``; ``abort`` is an infra error),
                                ``weight_versions`` ``[{version, start, end}]`` token spans
``usage.prompt_tokens``         the context length as the server counted it (image pads expanded)
``GET /weight_info``            ``weight_version`` (a str; ``"default"`` before any update)
``GET /server_info``            ``?config_format=json``: the engine config (model path, logprobs
                                mode, tokenizer, parallel sizes, weight-transfer backend)
``POST /pause?mode=wait``       no new requests scheduled; in-flight ones finish; KV and prefix
                                caches cleared (no stale KV from the old weights). ``/resume``
``POST /collective_rpc``        ``{method: reload_weights, kwargs: {weights_path}}``: every worker
                                reloads the HF directory in place (the CPU path: no weight-transfer
                                engine of vLLM 0.32 runs without a GPU)
``/update_weight_version``      ``{new_version}``
NCCL (GPU servers, ``--weight-transfer-config '{"backend": "nccl"}'``):
``/init_weight_transfer_engine`` ``{init_info: {nccl_unique_id_b64, rank_offset, world_size}}``:
                                the server's ranks join the trainer's NCCL group (trainer = rank 0)
``/start_weight_update``,       each bucket announced by ``{update_info: {names, dtype_names,
``/update_weights``,            shapes}}`` and broadcast tensor by tensor from rank 0 while the
``/finish_weight_update``       call waits; ``{weight_version}`` ends the update
==============================  ==================================================================

Images: vLLM's Qwen3-VL processor replaces each single ``<|image_pad|>`` with the pads of its own
resize (``PromptReplacement`` targeting one pad, ``model_executor/models/qwen3_vl.py``), so an
expanded run would be expanded again: the client sends one pad per image, and the server's
``usage.prompt_tokens`` (counted after its expansion) must equal the trainer's context length,
which pre-flight checks (equal only when the servers' processor settings equal the trainer's).
Unverified against a server: vLLM's CPU build cannot load its image stack.

Logprobs: the server must run with ``--logprobs-mode processed_logprobs`` (the default,
``raw_logprobs``, is taken before temperature); processed logprobs are ``log_softmax(logits / T)``
(greedy: T = 1), renormalised over the top-p nucleus when ``top_p < 1``, so they equal the
trainer's at ``top_p = 1`` (the GRPO recipes'). Pre-flight checks both.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from osvl.rollout.engine import EngineError, GenerationRequest, GenerationResult, StopKind
from osvl.rollout.server_admin import FleetConfig, ServerFleet
from osvl.rollout.sglang import image_data_url

PROCESSED_LOGPROBS = "processed_logprobs"


@dataclass(frozen=True)
class VLLMConfig(FleetConfig):
    image_token_id: int | None = None  # the policy's <|image_pad|>: requests with images need it


def collapse_image_pads(input_ids: Sequence[int], images: Sequence, image_token_id: int) -> list[int]:
    """Each image's run of ``image_token_id`` as one id (vLLM's processor expands it again); the runs
    must be the images' ``num_tokens`` long, in order, or the request is malformed."""
    out: list[int] = []
    runs: list[int] = []
    for token in input_ids:
        if token == image_token_id and out and out[-1] == image_token_id:
            runs[-1] += 1
            continue
        if token == image_token_id:
            runs.append(1)
        out.append(token)
    expected = [image.num_tokens for image in images]
    if runs != expected:
        raise ValueError(f"image pad runs of lengths {runs} for images of {expected} tokens")
    return out


def generate_payload(request: GenerationRequest, image_token_id: int | None = None) -> dict[str, Any]:
    s = request.sampling
    sampling: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.max_new_tokens,
        "logprobs": 0,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": True,
        "skip_special_tokens": False,
        "detokenize": bool(s.stop),
    }
    if s.stop:
        sampling.update(stop=list(s.stop), include_stop_str_in_output=True)
    if s.seed is not None:
        sampling["seed"] = s.seed
    payload: dict[str, Any] = {"token_ids": list(request.input_ids), "sampling_params": sampling}
    if request.images:
        if image_token_id is None:
            raise ValueError("a request with images needs VLLMConfig.image_token_id (the policy's <|image_pad|>)")
        payload["token_ids"] = collapse_image_pads(request.input_ids, request.images, image_token_id)
        payload["content_parts"] = [
            {"type": "image_url", "url": image_data_url(image.pixels)} for image in request.images
        ]
    return payload


def _served_version(spans: Any, fallback: int) -> int:
    """The oldest weight version among the tokens' spans when osvl set them (integers), else ``fallback``."""
    versions = [str(span.get("version", "")) for span in spans or [] if isinstance(span, dict)]
    numbers = [int(v) for v in versions if v.isdigit()]
    return min(numbers) if numbers and len(numbers) == len(versions) else fallback


def parse_generate_response(body: Any, policy_version: int) -> GenerationResult:
    """``GenerationResult`` from an ``/inference/v1/generate`` body; malformed bodies are infra errors."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        content = choice["logprobs"]["content"]
        logprobs = [float(entry["logprob"]) for entry in content]
        scored = [int(entry["token_id"]) for entry in content]
        finish = choice["finish_reason"]
        prompt_tokens = int((body.get("usage") or {}).get("prompt_tokens") or 0)
    except (KeyError, TypeError, IndexError, ValueError) as error:
        raise EngineError(f"malformed vLLM /inference/v1/generate response ({error!r}): {str(body)[:200]}") from None
    if scored != ids:
        raise EngineError("vLLM token_ids and logprob token ids disagree")
    if finish not in ("stop", "length"):
        raise EngineError(f"vLLM generation ended with finish_reason {finish!r}")
    version = _served_version(choice.get("weight_versions"), policy_version)
    return GenerationResult(ids, logprobs, StopKind(finish), version, prompt_tokens)


def _refusal(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return str(message or body.get("detail") or body)[:300]
    return str(body)[:300]


class VLLMEngine(ServerFleet):
    """The ``Engine`` protocol over vLLM servers, and their pause, reload, NCCL-update and version routes.

    Every failure names its server; a weight update counts only once every server reports the new
    version on ``/weight_info`` (never assumed from a 200)."""

    kind = "vLLM"
    version_route = "/weight_info"

    config: VLLMConfig

    def for_server(self, url: str) -> VLLMEngine:
        """This client aimed at one server (pre-flight probes each), sharing the connection pool."""
        config = VLLMConfig((url,), timeout_s=self.config.timeout_s, image_token_id=self.config.image_token_id)
        return VLLMEngine(config, self.client, self._version)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        server = self._pick()
        url, version = self.config.urls[server], self._version
        self.in_flight[server] += 1
        try:
            payload = generate_payload(request, self.config.image_token_id)
            response = await self.client.post(f"{url}/inference/v1/generate", json=payload)
        except httpx.HTTPError as error:
            raise EngineError(f"vLLM server {url} unreachable: {error!r}") from None
        finally:
            self.in_flight[server] -= 1
        if response.status_code != 200:
            raise EngineError(
                f"vLLM /inference/v1/generate on {url} returned HTTP {response.status_code}: {_refusal(response)}"
            )
        try:
            body = response.json()
        except ValueError:
            raise EngineError(f"vLLM server {url} answered non-JSON: {response.text[:200]}") from None
        return parse_generate_response(body, version)

    async def _post(self, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = await self.client.post(f"{url}{path}", json=body)
        except httpx.HTTPError as error:
            raise EngineError(f"vLLM server {url}: POST {path} failed: {error!r}") from None
        if response.status_code != 200:
            raise EngineError(
                f"vLLM server {url}: POST {path} returned HTTP {response.status_code}: {_refusal(response)}"
            )
        return response.json() if response.content else None

    async def _each(self, what: str, step) -> None:
        """``step(url)`` on every weight server concurrently; all failures reported together."""
        urls = self.config.weight_urls
        outcomes = await asyncio.gather(*(step(url) for url in urls), return_exceptions=True)
        failures = [
            str(o) if isinstance(o, EngineError) else f"{url}: {o!r}"
            for url, o in zip(urls, outcomes)
            if isinstance(o, BaseException)
        ]
        if failures:
            raise EngineError(f"{what} failed on {len(failures)} of {len(urls)} vLLM server(s): " + "; ".join(failures))

    async def server_config(self, url: str, timeout_s: float | None = None) -> dict[str, Any]:
        """The server's engine config (``/server_info?config_format=json``)."""
        info = await self.get_json(url, "/server_info?config_format=json", timeout_s)
        config = info.get("vllm_config") if isinstance(info, dict) else None
        if not isinstance(config, dict):
            raise EngineError(
                f"vLLM server {url}: /server_info has no JSON vllm_config (is VLLM_SERVER_DEV_MODE=1 set?)"
            )
        return config

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Every weight server pauses (in-flight requests finish, caches cleared), reloads the HF
        directory ``model_path`` in place, takes ``version`` and resumes; then the versions are checked."""

        async def reload(url: str) -> None:
            await self._post(url, "/pause?mode=wait")
            try:
                await self._post(
                    url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
                )
                await self._post(url, "/update_weight_version", {"new_version": str(version)})
            finally:
                await self._post(url, "/resume")

        await self._each(f"weight reload to version {version} from {model_path}", reload)
        await self.confirm_version(version)

    async def server_ranks(self) -> list[int]:
        """Each weight server's worker count (TP x PP x DP): its ranks in the weight-transfer group."""

        async def ranks(url: str) -> int:
            return int((await self.get_json(url, "/get_world_size")).get("world_size") or 1)

        return list(await asyncio.gather(*(ranks(url) for url in self.config.weight_urls)))

    async def init_weight_transfer(self, unique_id: bytes, sizes: Sequence[int]) -> None:
        """Every weight server joins the NCCL group of ``unique_id`` (trainer = rank 0; server i's ranks
        start at 1 + its predecessors' sizes). Returns once all joined: the trainer joins meanwhile."""
        encoded = base64.b64encode(unique_id).decode()
        offsets = dict(zip(self.config.weight_urls, (1 + sum(sizes[:i]) for i in range(len(sizes)))))

        async def join(url: str) -> None:
            await self._post(
                url,
                "/init_weight_transfer_engine",
                {
                    "init_info": {
                        "nccl_unique_id_b64": encoded,
                        "rank_offset": offsets[url],
                        "world_size": 1 + sum(sizes),
                    }
                },
            )

        await self._each("joining the weight-transfer group", join)

    async def start_weight_update(self) -> None:
        async def start(url: str) -> None:
            await self._post(url, "/pause?mode=wait")
            await self._post(url, "/start_weight_update")

        await self._each("starting a weight update", start)

    async def update_weights(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        """Announces one bucket; returns once every server received it (broadcast it meanwhile)."""
        info = {"update_info": {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]}}

        async def announce(url: str) -> None:
            await self._post(url, "/update_weights", info)

        await self._each(f"bucket of {len(names)} tensors", announce)

    async def finish_weight_update(self, version: int) -> None:
        async def finish(url: str) -> None:
            try:
                await self._post(url, "/finish_weight_update", {"weight_version": str(version)})
            finally:
                await self._post(url, "/resume")

        await self._each(f"finishing the weight update to version {version}", finish)
        await self.confirm_version(version)

    async def shutdown_weight_transfer(self) -> None:
        await self._each(
            "leaving the weight-transfer group", lambda url: self._post(url, "/shutdown_weight_transfer_engine")
        )

    async def take_restarts(self) -> int:
        """Always 0: this client does not watch for restarts; a server that goes away fails the step that
        needs it, naming it (the SGLang client waits for one to come back)."""
        return 0
