"""What every rollout engine speaks: a typed request, a typed result, reproducible seeds.

An engine turns ``(input_ids, images, sampling)`` into generated ids with the fp32 logprob of
each id under the full tempered distribution (``log_softmax(logits / temperature)``; the logits
at temperature 1 for greedy decoding), the quantity the trainer recomputes, whatever the engine
kept out of the draw (the top-p tail, reserved vision ids). Token parity: the ids a result carries are the ids
the trainer will score, so engines never detokenize and re-encode.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from osvl.data.image import ProcessedImage

DEFAULT_STOP = ("</tool_call>", "</response>")


class EngineError(RuntimeError):
    """The engine itself failed (process crash, server down): an infra error, never the policy's."""


class GenerationPreempted(EngineError):
    """A weight update aborted the request (``rollout.partial_rollouts = "restart"``): the rollout
    starts again on the new weights; neither a policy nor an infra error."""


class StopKind(str, enum.Enum):
    STOP = "stop"  # a stop string or stop id was generated (it is kept in the ids)
    LENGTH = "length"  # max_new_tokens reached without a stop
    ABORT = "abort"  # cut short by a pause for a weight update (the ids so far are kept); never reaches a rollout


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 512
    stop: tuple[str, ...] = DEFAULT_STOP
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty str, got {self.stop!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")


@dataclass
class GenerationRequest:
    input_ids: list[int]  # the full context, image pads included
    images: list[ProcessedImage] = field(default_factory=list)  # in the order of their pad runs
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("a generation request needs at least one input id")


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]  # fp32 values, one per token id
    finish: StopKind
    policy_version: int = 0  # weights that produced these tokens (the first of them, when they span an update)
    prompt_tokens: int = 0
    token_versions: list[int] | None = None  # per token, when a weight update fell inside the generation

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.token_versions)} token versions")
        self.finish = StopKind(self.finish)


class Engine(Protocol):
    """An async generator of one request at a time; engines batch concurrent requests inside."""

    @property
    def policy_version(self) -> int: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...


def derive_seed(step: int, prompt_id: str, sample_index: int, base_seed: int = 0) -> int:
    """A 63-bit seed fixed by (run seed, RL step, prompt, sample): reruns reproduce each sample
    whatever the batch composition or the order requests reach the engine."""
    key = f"{base_seed}\x1f{step}\x1f{prompt_id}\x1f{sample_index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def hits_stop(token_ids: Sequence[int], text_of, stop: Sequence[str], stop_token_ids: Sequence[int]) -> bool:
    """Whether the last token ends generation: a stop id, or a stop string completed by it.

    ``text_of(ids)`` decodes ids; only the tail is decoded, long enough to hold any stop string,
    and a string already present before the last token would have stopped generation earlier.
    """
    if not token_ids:
        return False
    if token_ids[-1] in stop_token_ids:
        return True
    if not stop:
        return False
    window = max(len(s) for s in stop) + 2  # every token decodes to at least one character
    tail = list(token_ids[-window:])
    text = text_of(tail)
    before = text_of(tail[:-1]) if len(tail) > 1 else ""
    return any(s in text and s not in before for s in stop)
