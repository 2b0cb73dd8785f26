"""The trajectory record: what the rollout recorder writes and the trainer reads.

One multi-turn rollout is a :class:`Trajectory` of :class:`Step` s. Each step keeps the exact token
ids and logprobs the engine produced (token parity: the trainer never re-tokenizes), the parsed
action, the typed :class:`ToolResult` of executing it, and the observation that was appended.

Images live in memory as ``numpy.uint8`` arrays of shape ``(H, W, 3)`` in RGB order. On disk a
batch is one JSONL file (one trajectory per line) plus an images directory holding each distinct
image once, as a PNG named by the SHA-256 of its pixels; the round trip is lossless.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from osvl.jsonl import iter_jsonl

SCHEMA_VERSION = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ToolStatus(str, enum.Enum):
    """Outcome of executing one tool call; only ``infra_error`` is not the policy's fault."""

    OK = "ok"
    TOOL_ERROR = "tool_error"  # the tool ran and rejected the call (bad arguments, no result)
    PARSE_ERROR = "parse_error"  # the action could not be parsed into a tool call
    INVALID_ARGUMENTS = "invalid_arguments"  # a known tool, but arguments that cannot be decoded or validated
    TIMEOUT = "timeout"  # the call ran past its deadline
    INFRA_ERROR = "infra_error"  # our side failed (worker crash, backend down)

    @classmethod
    def parse(cls, value: ToolStatus | str) -> ToolStatus:
        """Coerce a status string, failing loudly on anything outside the closed set."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown tool status {value!r}; expected one of: {allowed}") from None


POLICY_ERRORS = frozenset(
    {ToolStatus.TOOL_ERROR, ToolStatus.PARSE_ERROR, ToolStatus.INVALID_ARGUMENTS, ToolStatus.TIMEOUT}
)


class FinishReason(str, enum.Enum):
    """Why a rollout stopped."""

    RESPONSE = "response"  # the policy emitted a final <response>
    FATAL = "fatal"  # aborted by the consecutive-error rule
    # a generation that cannot be rendered into a next turn (reserved vision or out-of-vocabulary ids):
    # stopped at once; with no response, the fatal rule counts it fatal at its end (osvl.rl.fatal)
    MALFORMED = "malformed"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"  # generation or context budget exhausted
    INFRA_ERROR = "infra_error"  # our infrastructure failed; the rollout is retried or dropped


def check_image(image: np.ndarray) -> np.ndarray:
    """Validate the in-memory image convention (uint8, HxWx3, RGB) so bad pixels fail early."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise ValueError(
            f"images must be numpy uint8 arrays, got {type(image).__name__}"
            f"{'/' + str(image.dtype) if isinstance(image, np.ndarray) else ''}"
        )
    if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] == 0 or image.shape[1] == 0:
        raise ValueError(f"images must have shape (H, W, 3) with H, W > 0, got {image.shape}")
    return image


def image_sha256(image: np.ndarray) -> str:
    """Content hash over shape and pixels: identical pixels share one file on disk."""
    check_image(image)
    digest = hashlib.sha256()
    digest.update(repr(tuple(image.shape)).encode())
    digest.update(np.ascontiguousarray(image).tobytes())
    return digest.hexdigest()


@dataclass
class ToolResult:
    """What executing one tool call produced; failures are statuses, not exceptions."""

    status: ToolStatus
    tool: str  # tool name as called ("" when the call could not be parsed)
    text: str = ""  # textual observation (may be empty for image-only tools)
    images: list[np.ndarray] = field(default_factory=list)  # images the tool produced
    error: str | None = None  # human-readable cause when status is not ok
    elapsed_s: float = 0.0
    queue_s: float = 0.0  # waiting for a worker (0 when the call never reached a pool)
    run_s: float = 0.0  # from the worker receiving the call to its answer
    worker: str = ""  # which worker ran it ("pid 123", "http://host:port pid 123"); "" when none did
    overloads: int = 0  # overload answers (tool server HTTP 503 "overloaded") the call waited out first
    overloaded: bool = False  # an infra_error because the tool servers stayed overloaded past the call's deadline

    def __post_init__(self) -> None:
        self.status = ToolStatus.parse(self.status)
        for image in self.images:
            check_image(image)

    @property
    def ok(self) -> bool:
        return self.status is ToolStatus.OK

    @property
    def observation(self) -> str:
        """What the agent reads back: the text, or the failure typed by its status (rollouts, experts
        and drills write it the same way, so a policy meets in RL the error text SFT showed it)."""
        return self.text if self.ok else f"Error ({self.status.value}): {self.error}"


@dataclass
class ToolCall:
    """A parsed action: tool name plus JSON arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class Step:
    """One policy turn: the generation, its parsed action, and the environment's answer."""

    token_ids: list[int]  # exactly what the engine generated
    logprobs: list[float]  # engine logprob of each generated token
    text: str = ""  # decoded generation (special tokens stripped), used for the format reward
    think: str | None = None
    tool_call: ToolCall | None = None
    response: str | None = None  # final answer text, only on a terminal step
    tool_result: ToolResult | None = None  # None when the step made no tool call
    observation_text: str = ""  # what was appended to the context after this step
    observation_images: list[np.ndarray] = field(default_factory=list)
    observation_token_ids: list[int] = field(default_factory=list)
    policy_version: int = 0  # weights version that generated this step (its first token, if an update fell inside)
    token_versions: list[int] = field(default_factory=list)  # per token when a weight update fell inside; else []

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"token_ids ({len(self.token_ids)}) and logprobs ({len(self.logprobs)}) differ in length")
        if self.token_versions and len(self.token_versions) != len(self.token_ids):
            raise ValueError(
                f"token_ids ({len(self.token_ids)}) and token_versions ({len(self.token_versions)}) differ in length"
            )
        for image in self.observation_images:
            check_image(image)

    @property
    def versions(self) -> list[int]:
        """The policy version of every generated token."""
        return list(self.token_versions) if self.token_versions else [self.policy_version] * len(self.token_ids)

    @property
    def status(self) -> ToolStatus | None:
        """The tool status, or None for a step without a tool call (e.g. the final response)."""
        return self.tool_result.status if self.tool_result is not None else None


@dataclass
class Prompt:
    """One RL question with its reference answer and accepted aliases."""

    id: str
    question: str
    images: list[np.ndarray] = field(default_factory=list)
    answer: str = ""
    aliases: list[str] = field(default_factory=list)
    # where the question starts (its anchor entity) and how many relation hops lead from it to the asked
    # page: questions about one entity are not independent draws, so evaluations resample anchors
    anchor: str = ""
    hops: int = 0

    def __post_init__(self) -> None:
        if self.hops < 0:
            raise ValueError(f"prompt {self.id}: hops must be >= 0, got {self.hops}")
        for image in self.images:
            check_image(image)

    @property
    def accepted_answers(self) -> list[str]:
        return [a for a in [self.answer, *self.aliases] if a]


@dataclass
class RewardParts:
    """Composite reward and its parts. ``total`` is None when a judge could not answer."""

    fmt: float
    acc: float | None
    query: float | None
    total: float | None
    unscored_reason: str | None = None  # why a judge gave no verdict (timeout, http_401, ...)

    @property
    def scored(self) -> bool:
        return self.total is not None


@dataclass
class Trajectory:
    """A full rollout of one prompt, one of the ``group_id`` group's samples."""

    prompt: Prompt
    steps: list[Step]
    finish_reason: FinishReason
    group_id: int
    sample_index: int
    # first masked step (set by rewards.score_trajectory): len(steps) = fatal at the end, -1 = none
    fatal_step: int = -1
    reward: RewardParts | None = None
    infra_retries: int = 0  # rollouts restarted because of infra errors before this one

    def __post_init__(self) -> None:
        self.finish_reason = FinishReason(self.finish_reason)

    @property
    def final_answer(self) -> str | None:
        """The terminal <response> text, or None when the rollout ended without one."""
        if self.steps and self.steps[-1].response is not None:
            return self.steps[-1].response
        return None

    @property
    def statuses(self) -> list[ToolStatus | None]:
        return [step.status for step in self.steps]


# ---------------------------------------------------------------------------------------------
# JSONL serialization


class ImageStore:
    """Directory of PNG files named ``<sha256>.png``; writes are atomic and deduplicated."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def put(self, image: np.ndarray) -> str:
        sha = image_sha256(image)
        target = self.directory / f"{sha}.png"
        if not target.exists():
            import cv2  # image files only: the training path runs without OpenCV (GPU images may lack it)

            ok, png = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
            if not ok:
                raise ValueError(f"PNG encoding failed for image of shape {image.shape}")
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as handle:
                handle.write(png.tobytes())
            os.replace(tmp, target)
        return sha

    def get(self, sha: str) -> np.ndarray:
        path = self.directory / f"{sha}.png"
        import cv2

        data = np.fromfile(path, dtype=np.uint8)
        decoded = cv2.imdecode(data, cv2.IMREAD_COLOR)
        if decoded is None:
            raise ValueError(f"cannot decode image {path}")
        image = cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB)
        if image_sha256(image) != sha:
            raise ValueError(f"image {path} does not match its content hash")
        return image


def _images_out(images: list[np.ndarray], store: ImageStore) -> list[str]:
    return [store.put(image) for image in images]


def _images_in(hashes: list[str], store: ImageStore | None) -> list[np.ndarray]:
    return [store.get(sha) for sha in hashes] if store is not None else []


def _float_out(value: float) -> float | str:
    """JSON has no inf/nan; keep them as strings so -inf logprobs survive strict parsers."""
    return value if math.isfinite(value) else repr(float(value))


def _float_in(value: float | str) -> float:
    return float(value)


def _tool_result_out(result: ToolResult, store: ImageStore) -> dict[str, Any]:
    return {
        "status": result.status.value,
        "tool": result.tool,
        "text": result.text,
        "images": _images_out(result.images, store),
        "error": result.error,
        "elapsed_s": result.elapsed_s,
        "queue_s": result.queue_s,
        "run_s": result.run_s,
        "worker": result.worker,
        "overloads": result.overloads,
        "overloaded": result.overloaded,
    }


def _tool_result_in(data: Mapping[str, Any], store: ImageStore | None) -> ToolResult:
    return ToolResult(
        status=ToolStatus.parse(data["status"]),
        tool=data["tool"],
        text=data["text"],
        images=_images_in(data["images"], store),
        error=data["error"],
        elapsed_s=data["elapsed_s"],
        queue_s=data.get("queue_s", 0.0),  # absent in records written before these were kept
        run_s=data.get("run_s", 0.0),
        worker=data.get("worker", ""),
        overloads=data.get("overloads", 0),
        overloaded=data.get("overloaded", False),
    )


def _step_out(step: Step, store: ImageStore) -> dict[str, Any]:
    return {
        "token_ids": [int(t) for t in step.token_ids],
        "logprobs": [_float_out(float(lp)) for lp in step.logprobs],
        "text": step.text,
        "think": step.think,
        "tool_call": None
        if step.tool_call is None
        else {"name": step.tool_call.name, "arguments": step.tool_call.arguments},
        "response": step.response,
        "tool_result": None if step.tool_result is None else _tool_result_out(step.tool_result, store),
        "observation_text": step.observation_text,
        "observation_images": _images_out(step.observation_images, store),
        "observation_token_ids": [int(t) for t in step.observation_token_ids],
        "policy_version": step.policy_version,
        "token_versions": [int(v) for v in step.token_versions],
    }


def _step_in(data: Mapping[str, Any], store: ImageStore | None) -> Step:
    call = data["tool_call"]
    result = data["tool_result"]
    return Step(
        token_ids=list(data["token_ids"]),
        logprobs=[_float_in(lp) for lp in data["logprobs"]],
        text=data["text"],
        think=data["think"],
        tool_call=None if call is None else ToolCall(name=call["name"], arguments=call["arguments"]),
        response=data["response"],
        tool_result=None if result is None else _tool_result_in(result, store),
        observation_text=data["observation_text"],
        observation_images=_images_in(data["observation_images"], store),
        observation_token_ids=list(data["observation_token_ids"]),
        policy_version=data["policy_version"],
        token_versions=list(data.get("token_versions", [])),  # absent in records written before async rollouts
    )


def _prompt_out(prompt: Prompt, images: list[str]) -> dict[str, Any]:
    """A prompt's JSON fields with its images as references; ``anchor`` and ``hops`` only when known."""
    out = {"id": prompt.id, "question": prompt.question, "images": images, "answer": prompt.answer}
    out["aliases"] = list(prompt.aliases)
    if prompt.anchor:
        out["anchor"] = prompt.anchor
    if prompt.hops:
        out["hops"] = prompt.hops
    return out


def _prompt_in(data: Mapping[str, Any], images: list[np.ndarray]) -> Prompt:
    return Prompt(
        id=data["id"],
        question=data["question"],
        images=images,
        answer=data["answer"],
        aliases=list(data["aliases"]),
        anchor=data.get("anchor", ""),
        hops=data.get("hops", 0),
    )


def trajectory_to_dict(traj: Trajectory, store: ImageStore) -> dict[str, Any]:
    """JSON-ready dict; images are written to ``store`` and referenced by hash."""
    prompt = traj.prompt
    reward = traj.reward
    return {
        "schema": SCHEMA_VERSION,
        "prompt": _prompt_out(prompt, _images_out(prompt.images, store)),
        "steps": [_step_out(step, store) for step in traj.steps],
        "finish_reason": traj.finish_reason.value,
        "group_id": traj.group_id,
        "sample_index": traj.sample_index,
        "fatal_step": traj.fatal_step,
        "reward": None
        if reward is None
        else {
            "fmt": reward.fmt,
            "acc": reward.acc,
            "query": reward.query,
            "total": reward.total,
            "unscored_reason": reward.unscored_reason,
        },
        "infra_retries": traj.infra_retries,
    }


def trajectory_from_dict(data: Mapping[str, Any], store: ImageStore | None) -> Trajectory:
    """The record as a trajectory; ``store=None`` decodes no image and leaves every image list empty,
    for readers that take the images by :func:`image_hashes`."""
    if data.get("schema") != SCHEMA_VERSION:
        raise ValueError(
            f"unsupported trajectory schema {data.get('schema')!r}; this reader understands {SCHEMA_VERSION}"
        )
    prompt = data["prompt"]
    reward = data["reward"]
    return Trajectory(
        prompt=_prompt_in(prompt, _images_in(prompt["images"], store)),
        steps=[_step_in(step, store) for step in data["steps"]],
        finish_reason=FinishReason(data["finish_reason"]),
        group_id=data["group_id"],
        sample_index=data["sample_index"],
        fatal_step=data["fatal_step"],
        reward=None if reward is None else RewardParts(**reward),
        infra_retries=data["infra_retries"],
    )


def image_hashes(data: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """A trajectory record's prompt images and each step's observation images, as content hashes."""
    hashes = (list(data["prompt"]["images"]), [list(step["observation_images"]) for step in data["steps"]])
    for sha in [*hashes[0], *(sha for step in hashes[1] for sha in step)]:
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise ValueError(f"image reference {sha!r} is not a SHA-256 hex digest")
    return hashes


def default_images_dir(jsonl_path: str | os.PathLike[str]) -> Path:
    """``runs/x/rollouts.jsonl`` -> ``runs/x/images``: files beside the JSONL share one store."""
    return Path(jsonl_path).parent / "images"


def append_jsonl(
    path: str | os.PathLike[str], trajectories: Iterable[Trajectory], images_dir: str | os.PathLike[str] | None = None
) -> int:
    """Append trajectories, one JSON line each; returns how many were written."""
    store = ImageStore(images_dir if images_dir is not None else default_images_dir(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "a", encoding="utf-8") as handle:
        for traj in trajectories:
            line = json.dumps(trajectory_to_dict(traj, store), ensure_ascii=False, allow_nan=False)
            handle.write(line + "\n")
            written += 1
    return written


def read_jsonl(path: str | os.PathLike[str], images_dir: str | os.PathLike[str] | None = None) -> Iterator[Trajectory]:
    """Yield trajectories in file order; blank lines are skipped."""
    store = ImageStore(images_dir if images_dir is not None else default_images_dir(path))
    for _, data in iter_jsonl(path):
        yield trajectory_from_dict(data, store)


def write_prompts(
    path: str | os.PathLike[str], prompts: Iterable[Prompt], images_dir: str | os.PathLike[str] | None = None
) -> int:
    """RL prompts as JSONL (``id, question, images, answer, aliases``; ``anchor, hops`` when known), images by
    content hash beside the file, the same convention as trajectory JSONL."""
    store = ImageStore(images_dir if images_dir is not None else Path(path).parent / "images")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "a", encoding="utf-8", newline="\n") as handle:
        for prompt in prompts:
            handle.write(
                json.dumps(_prompt_out(prompt, [store.put(i) for i in prompt.images]), ensure_ascii=False) + "\n"
            )
            written += 1
    return written


def read_prompts(path: str | os.PathLike[str], images_dir: str | os.PathLike[str] | None = None) -> Iterator[Prompt]:
    store = ImageStore(images_dir if images_dir is not None else Path(path).parent / "images")
    for _, data in iter_jsonl(path):
        yield _prompt_in(data, [store.get(s) for s in data["images"]])
