"""The local engine: osvl's own model with a KV cache, batched, on CPU or GPU.

Concurrent ``generate`` calls are gathered into one batch (up to ``max_batch`` rows): one padded
prefill of every row's context (images included), then one decode step per token for all rows.
Weights are swapped in place between batches (``load_weights``), stamping a new policy version.
With ``prefix_cache_tokens > 0`` a request that extends an earlier generation's context (the next
turn of a rollout) reuses that context's keys/values and prefills only the new tokens.
Reserved vision placeholders and the model's padded vocabulary rows are never sampled
(see :mod:`osvl.rollout.reserved`). ``abort`` ends every request in flight as ``StopKind.ABORT``
with the tokens it has (the loopback server's ``/pause_generation``) until ``resume``.

Batched results depend on the batch: padding sets the shapes of every matmul and the width of every
attention reduction, and floating-point sums taken in another order round differently. Which
requests share a batch depends on when they arrive, so two identical runs differ in the last bits
of their logprobs, then in sampled tokens. With ``deterministic=True`` every request runs alone
(``[1, L]`` prefill and decode, a cache sized by the request): each result is a function of the
request and the weights only, whatever else is in flight and in whatever order it arrived.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from osvl.data.image import ImageConfig, pixel_values
from osvl.data.mrope import mrope_position_ids
from osvl.data.tokenizer import Tokenizer
from osvl.model.model import Qwen3VLModel
from osvl.rollout.engine import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    StopKind,
    hits_stop,
)
from osvl.rollout.kv_cache import KVCache, extend
from osvl.rollout.prefix_cache import Prefix, PrefixCache, image_key
from osvl.rollout.reserved import reserved_vision_ids
from osvl.rollout.sampling import make_generator, sample_next


def _pad(rows: Sequence[np.ndarray], fill: int = 0) -> np.ndarray:
    width = max(r.shape[-1] for r in rows)
    out = np.full((len(rows), *rows[0].shape[:-1], width), fill, dtype=np.int64)
    for b, row in enumerate(rows):
        out[b, ..., : row.shape[-1]] = row
    return out


class LocalEngine:
    def __init__(
        self,
        model: Qwen3VLModel,
        tokenizer: Tokenizer,
        image_config: ImageConfig,
        *,
        max_batch: int = 8,
        policy_version: int = 0,
        prefix_cache_tokens: int = 0,
        deterministic: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        if deterministic and prefix_cache_tokens:
            # a hit prefills only the new tokens (other matmul shapes than a miss), and whether an entry
            # survives eviction depends on the order concurrent rollouts stored theirs
            raise ValueError("prefix_cache_tokens must be 0 in deterministic mode: cache hits depend on arrival order")
        if model.arch.image_token_id != tokenizer.special.image_pad:
            raise ValueError(
                f"model image_token_id {model.arch.image_token_id} != tokenizer's <|image_pad|> "
                f"{tokenizer.special.image_pad}"
            )
        if model.arch.text.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model vocab {model.arch.text.vocab_size} < tokenizer vocab {tokenizer.vocab_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.max_batch = max_batch
        self.deterministic = deterministic
        self._version = policy_version
        self._lock = threading.Lock()  # a batch and a weight swap never interleave
        self._abort = threading.Event()  # set: running rows stop at their next token, queued requests at once
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self.generated_tokens = 0
        self.prefilled_tokens = 0
        self.batch_sizes: Counter[int] = Counter()  # batches the request queue formed, by size
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self._banned = torch.tensor(
            [*reserved_vision_ids(tokenizer), *range(tokenizer.vocab_size, model.arch.text.vocab_size)],
            dtype=torch.long,
        )

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, *, partial: bool = False) -> None:
        """In-place copy of the trainer's weights (same names and shapes) before the next batch;
        ``partial`` takes a subset of the parameters (a bucket of a streamed update)."""
        with self._lock:
            missing, unexpected = self.model.load_state_dict(dict(state_dict), strict=False)
            if unexpected or (missing and not partial):
                raise ValueError(
                    f"weight update does not match the engine's model: missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}"
                )
            self._version = version
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # keys/values of the old weights

    def abort(self) -> None:
        """Ends every request in flight, and every request made until ``resume``, as ``StopKind.ABORT``."""
        self._abort.set()

    def resume(self) -> None:
        self._abort.clear()

    def _prefill_inputs(self, requests: Sequence[GenerationRequest], skips: Sequence[tuple[int, int]] | None = None):
        """Padded new ids, their MRoPE positions and new images; row b skips its first
        ``skips[b] = (tokens, images)``, which a prefix cache already holds."""
        pad_id = self.tokenizer.special.image_pad
        merge = self.image_config.merge_size
        ids, positions, images, next_position = [], [], [], []
        for request, (skip, skip_images) in zip(requests, skips or [(0, 0)] * len(requests)):
            row = np.asarray(request.input_ids, dtype=np.int64)
            if row.min() < 0 or row.max() >= self.model.arch.text.vocab_size:
                raise ValueError(f"input ids outside the vocabulary [0, {self.model.arch.text.vocab_size})")
            grids = [image.grid_thw for image in request.images]
            full = mrope_position_ids(row, grids, pad_id, merge)
            next_position.append(int(full.max()) + 1)
            positions.append(full[:, skip:])
            ids.append(row[skip:])
            images += request.images[skip_images:]
        device = self.device
        pixels = grid = None
        if images:
            pixels = torch.from_numpy(pixel_values(images, self.image_config)).to(
                device, next(self.model.parameters()).dtype
            )
            grid = torch.tensor([image.grid_thw for image in images], device=device)
        lengths = torch.tensor([len(r) for r in ids], device=device)
        return (
            torch.from_numpy(_pad(ids)).to(device),
            lengths,
            torch.from_numpy(_pad(positions)).to(device).permute(1, 0, 2),
            pixels,
            grid,
            next_position,
        )

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Synchronous batched generation (one request at a time in deterministic mode); each row
        samples with its own seeded generator."""
        if not requests:
            return []
        with self._lock:
            if self.deterministic:
                return [self._generate([request])[0] for request in requests]
            return self._generate(requests)

    def _generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        image_keys = [
            [image_key(image) for image in r.images] if self.prefix_cache is not None else [] for r in requests
        ]
        prefixes = (
            [self.prefix_cache.lookup(r.input_ids, keys) for r, keys in zip(requests, image_keys)]
            if self.prefix_cache is not None
            else [None] * len(requests)
        )
        skips = [(len(p.ids), len(p.image_keys)) if p else (0, 0) for p in prefixes]
        ids, lengths, positions, pixels, grid, next_position = self._prefill_inputs(requests, skips)
        budget = max(r.sampling.max_new_tokens for r in requests)
        full = [len(r.input_ids) for r in requests]
        cache = KVCache.empty(self.model, len(requests), max(full) + budget)
        for b, prefix in enumerate(prefixes):
            if prefix is not None:
                n = len(prefix.ids)
                for layer, (keys, values) in enumerate(zip(prefix.keys, prefix.values)):
                    cache.keys[layer][b, :, :n] = keys
                    cache.values[layer][b, :, :n] = values
                cache.lengths[b] = n
        self.prefilled_tokens += int(lengths.sum())
        logits = extend(self.model, cache, ids, lengths, positions, pixels, grid)
        last = logits[torch.arange(len(requests)), lengths - 1]
        generators = [make_generator(r.sampling.seed, self.device) for r in requests]
        banned = self._banned.to(self.device)
        out_ids: list[list[int]] = [[] for _ in requests]
        out_lp: list[list[float]] = [[] for _ in requests]
        finish = [StopKind.LENGTH] * len(requests)
        active = [True] * len(requests)

        def decode(t):
            return self.tokenizer.decode(t)

        while True:
            if self._abort.is_set():
                finish = [StopKind.ABORT if active[b] else finish[b] for b in range(len(requests))]
                break
            step_ids = torch.zeros(len(requests), dtype=torch.long, device=self.device)
            for b, request in enumerate(requests):
                if not active[b]:
                    continue
                s = request.sampling
                token, logprob = sample_next(last[b], s.temperature, s.top_p, generators[b], banned)
                out_ids[b].append(token)
                out_lp[b].append(logprob)
                step_ids[b] = token
                if hits_stop(out_ids[b], decode, s.stop, s.stop_token_ids):
                    active[b], finish[b] = False, StopKind.STOP
                elif len(out_ids[b]) >= s.max_new_tokens:
                    active[b] = False
            if not any(active):
                break
            new = torch.tensor(active, dtype=torch.long, device=self.device)
            pos = torch.tensor(
                [next_position[b] + len(out_ids[b]) - 1 for b in range(len(requests))], device=self.device
            )
            last = extend(self.model, cache, step_ids[:, None], new, pos.view(1, -1, 1).expand(3, -1, 1))[:, 0]
        self.generated_tokens += sum(len(t) for t in out_ids)
        if self.prefix_cache is not None:
            for b, request in enumerate(requests):  # the last sampled token was never fed: not cached
                n = int(cache.lengths[b])
                self.prefix_cache.store(
                    Prefix(
                        tuple(request.input_ids) + tuple(out_ids[b][: n - full[b]]),
                        tuple(image_keys[b]),
                        [k[b, :, :n].clone() for k in cache.keys],
                        [v[b, :, :n].clone() for v in cache.values],
                    )
                )
        return [
            GenerationResult(
                token_ids=out_ids[b],
                logprobs=out_lp[b],
                finish=finish[b],
                policy_version=self._version,
                prompt_tokens=full[b],
            )
            for b in range(len(requests))
        ]

    @torch.no_grad()
    def score(self, request: GenerationRequest, continuation: Sequence[int], temperature: float = 1.0) -> list[float]:
        """fp32 logprobs of ``continuation`` after the request's context (teacher forcing)."""
        if not continuation:
            return []
        full = GenerationRequest(list(request.input_ids) + list(continuation), request.images, request.sampling)
        with self._lock:
            ids, lengths, positions, pixels, grid, _ = self._prefill_inputs([full])
            cache = KVCache.empty(self.model, 1, int(lengths.max()))
            logits = extend(self.model, cache, ids, lengths, positions, pixels, grid)[0].float()
        start = len(request.input_ids)
        logits = logits[start - 1 : start - 1 + len(continuation)] / (temperature or 1.0)
        target = torch.tensor(list(continuation), device=logits.device)
        return torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0].tolist()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Queue one request; requests made while a batch runs form the next batch."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let callers scheduled in the same tick join the batch
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            self.batch_sizes[len(batch)] += 1
            if self._abort.is_set():
                for request, future in batch:
                    if not future.done():
                        future.set_result(
                            GenerationResult([], [], StopKind.ABORT, self._version, len(request.input_ids))
                        )
                continue
            try:
                results = await asyncio.to_thread(self.generate_batch, [r for r, _ in batch])
            except Exception as error:  # noqa: BLE001 - one bad batch must not strand its callers
                for _, future in batch:
                    if not future.done():
                        future.set_exception(
                            error if isinstance(error, ValueError) else EngineError(f"local engine failed: {error!r}")
                        )
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)


class ReplayEngine:
    """Forced decoding: emits scripted ids with the real model's logprobs for them.

    ``script(request)`` returns the ids to "generate"; they are cut at the first stop and at
    ``max_new_tokens`` like sampled ones. Drives the agent loop deterministically in tests.
    """

    def __init__(self, engine: LocalEngine, script: Callable[[GenerationRequest], Sequence[int]]) -> None:
        self.engine = engine
        self.script = script

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(state_dict, version)

    def replay(self, request: GenerationRequest) -> GenerationResult:
        s = request.sampling
        ids: list[int] = []
        finish = StopKind.LENGTH
        for token in self.script(request):
            ids.append(int(token))
            if hits_stop(ids, self.engine.tokenizer.decode, s.stop, s.stop_token_ids):
                finish = StopKind.STOP
                break
            if len(ids) >= s.max_new_tokens:
                break
        while True:  # the version the logprobs were computed on: a weight swap may land in between
            version = self.engine.policy_version
            logprobs = self.engine.score(request, ids, s.temperature)
            if self.engine.policy_version == version:
                return GenerationResult(ids, logprobs, finish, version, len(request.input_ids))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await asyncio.to_thread(self.replay, request)
