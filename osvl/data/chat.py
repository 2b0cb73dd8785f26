"""Qwen3-VL chat rendering for ReAct trajectories, with the engine's ids spliced in verbatim.

The renderer owns only the ids *between* generations: the system turn with the tool schema,
the user turn, and each tool observation (the assistant turn's close, a ``user`` turn wrapping
``<tool_response>``, the next assistant header). What the engine generated is copied as is and
is exactly what ``loss_mask`` marks, so re-tokenisation drift cannot reach the loss.

One trajectory renders as (Qwen3-VL's template; ``[img]`` is
``<|vision_start|>`` + ``<|image_pad|>`` x num_tokens + ``<|vision_end|>``)::

    <|im_start|>system\\n{system}\\n\\n# Tools ... <tools>\\n{schema}\\n</tools> ... <|im_end|>\\n
    <|im_start|>user\\n[img][img]{question}<|im_end|>\\n
    <|im_start|>assistant\\n{step 0 ids}<|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n[img]{observation}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n{step 1 ids} ...

``<|im_end|>`` after a step is the renderer's unless the engine generated it (stopped on EOS
rather than on ``</tool_call>``). Observation images come before their text, as in the user turn.
A caller that holds a trajectory's images already processed (or deferred: SFT reads image files
only when it packs them) passes them as :class:`TrajectoryImages`; only their token counts matter here.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from osvl.data.image import DeferredImage, ImageConfig, ProcessedImage, process_image
from osvl.data.tokenizer import Tokenizer
from osvl.rl.trajectory import Prompt, Step, Trajectory

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def function_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI function-tool form ``{"type": "function", "function": {...}}`` of a schema dict."""
    if not isinstance(tool, Mapping):
        raise ValueError(f"a tool schema must be a dict, got {type(tool).__name__}")
    function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(function, Mapping):
        raise ValueError(f"tool schema must be an OpenAI function tool, got type={tool.get('type')!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool schema needs a non-empty 'name', got {name!r}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        raise ValueError(f"tool {name!r}: 'parameters' must be a JSON-schema dict")
    return {"type": "function", "function": dict(function, parameters=dict(parameters))}


def system_text(tools: Sequence[Mapping[str, Any]], system_prompt: str = "") -> str:
    """The system turn (empty when there is neither a prompt nor a tool)."""
    schemas = [function_schema(tool) for tool in tools]
    names = [schema["function"]["name"] for schema in schemas]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tool names: {sorted(n for n in set(names) if names.count(n) > 1)}")
    if not schemas:
        return f"<|im_start|>system\n{system_prompt}<|im_end|>\n" if system_prompt else ""
    lines = "".join("\n" + json.dumps(schema, ensure_ascii=False) for schema in schemas)
    prefix = system_prompt + "\n\n" if system_prompt else ""
    return f"<|im_start|>system\n{prefix}{TOOLS_HEADER}{lines}{TOOLS_FOOTER}<|im_end|>\n"


def parse_system_text(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(system_prompt, tools)`` that :func:`system_text` renders as ``text``; ValueError when no
    pair renders it exactly."""
    open_, close = "<|im_start|>system\n", "<|im_end|>\n"
    if not text:
        return "", []
    if not (text.startswith(open_) and text.endswith(close)):
        raise ValueError(f"not a system turn: {text[:80]!r}")
    body = text[len(open_) : -len(close)]
    prompt, tools = body, []
    at = body.rfind(TOOLS_HEADER)
    if at != -1 and body.endswith(TOOLS_FOOTER):
        lines = body[at + len(TOOLS_HEADER) : -len(TOOLS_FOOTER)]
        try:
            tools = [json.loads(line) for line in lines.split("\n")[1:]] if lines.startswith("\n") else None
        except json.JSONDecodeError:
            tools = None
        if tools:
            prompt = body[:at].removesuffix("\n\n") if at else ""
        else:
            tools = []
    if system_text(tools, prompt) != text:
        raise ValueError(f"system turn is not in osvl's format (prompt, then the tool schema): {text[:120]!r}")
    return prompt, tools


@dataclass
class Segment:
    """Renderer-owned ids and the images whose pad tokens they contain, in order."""

    ids: list[int]
    images: list[ProcessedImage | DeferredImage] = field(default_factory=list)


@dataclass(frozen=True)
class TrajectoryImages:
    """A trajectory's images in processed form: the prompt's, then each step's observation's."""

    prompt: list[ProcessedImage | DeferredImage]
    observations: list[list[ProcessedImage | DeferredImage]]


@dataclass
class RenderedSequence:
    """One trajectory as token arrays (all [L]) plus its ordered images."""

    input_ids: np.ndarray  # int64
    loss_mask: np.ndarray  # bool: generated by the engine (policy tokens)
    token_step: np.ndarray  # int64: step index (prompt -> 0, observation after step i -> i)
    logprobs: np.ndarray  # float32: engine logprob at policy tokens, 0 elsewhere
    images: list[ProcessedImage | DeferredImage]  # prompt images, then tool images


class ChatRenderer:
    """Renders prompts and observations; splices finished trajectories."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        image_config: ImageConfig,
        tools: Sequence[Mapping[str, Any]] = (),
        system_prompt: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.system = system_text(tools, system_prompt)

    def with_tokenizer(self, tokenizer: Tokenizer) -> ChatRenderer:
        """The same prompt rendered through another tokenizer (one that caches, say)."""
        renderer = copy.copy(self)
        renderer.tokenizer = tokenizer
        return renderer

    def _processed(
        self, images: Sequence[np.ndarray], processed: Sequence[ProcessedImage | DeferredImage] | None
    ) -> list[ProcessedImage | DeferredImage]:
        if processed is None:
            return [process_image(image, self.image_config) for image in images]
        if images and len(images) != len(processed):
            raise ValueError(f"{len(processed)} processed images given for {len(images)} images")
        return list(processed)

    @staticmethod
    def _image_text(processed: Sequence[ProcessedImage | DeferredImage]) -> str:
        return "".join("<|vision_start|>" + "<|image_pad|>" * p.num_tokens + "<|vision_end|>" for p in processed)

    def render_prompt(
        self, prompt: Prompt, processed: Sequence[ProcessedImage | DeferredImage] | None = None
    ) -> Segment:
        """System and user turns plus the assistant header: the first generation's input. ``processed``
        stands in for processing ``prompt.images``."""
        images = self._processed(prompt.images, processed)
        user = f"<|im_start|>user\n{self._image_text(images)}{prompt.question}<|im_end|>\n"
        text = f"{self.system}{user}<|im_start|>assistant\n"
        return Segment(self.tokenizer.encode(text), images)

    def render_observation(
        self, step: Step, processed: Sequence[ProcessedImage | DeferredImage] | None = None
    ) -> Segment:
        """What follows a step's generation up to the next assistant header."""
        processed = self._processed(step.observation_images, processed)
        images = self._image_text(processed)
        closed = bool(step.token_ids) and step.token_ids[-1] == self.tokenizer.special.im_end
        text = ("\n" if closed else "<|im_end|>\n") + (
            f"<|im_start|>user\n<tool_response>\n{images}{step.observation_text}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        return Segment(self.tokenizer.encode(text), processed)

    def _recorded_observation(
        self, step: Step, index: int, processed: Sequence[ProcessedImage | DeferredImage] | None
    ) -> Segment:
        """The ids the agent loop recorded (verbatim) or, when none were, the rendered ones."""
        if not step.observation_token_ids:
            return self.render_observation(step, processed)
        processed = self._processed(step.observation_images, processed)
        pads = sum(1 for i in step.observation_token_ids if i == self.tokenizer.special.image_pad)
        if pads != sum(p.num_tokens for p in processed):
            raise ValueError(
                f"step {index}: recorded observation has {pads} image tokens but its "
                f"{len(processed)} image(s) need {sum(p.num_tokens for p in processed)} "
                f"(image processor config differs from the rollout's?)"
            )
        return Segment(list(step.observation_token_ids), processed)

    def render_trajectory(self, trajectory: Trajectory, given: TrajectoryImages | None = None) -> RenderedSequence:
        """Prompt, then each step's engine ids verbatim, with an observation between steps; ``given``
        stands in for processing the trajectory's own images."""
        if given is not None and len(given.observations) != len(trajectory.steps):
            raise ValueError(
                f"trajectory {trajectory.prompt.id!r}: images for {len(given.observations)} observations, "
                f"{len(trajectory.steps)} steps"
            )
        prompt = self.render_prompt(trajectory.prompt, given.prompt if given is not None else None)
        pieces: list[tuple[list[int], bool, int, list[float]]] = [(prompt.ids, False, 0, [])]
        images = list(prompt.images)
        for index, step in enumerate(trajectory.steps):
            pieces.append((list(step.token_ids), True, index, list(step.logprobs)))
            if index + 1 < len(trajectory.steps):
                processed = given.observations[index] if given is not None else None
                observation = self._recorded_observation(step, index, processed)
                pieces.append((observation.ids, False, index, []))
                images += observation.images
        input_ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids, *_ in pieces])
        loss_mask = np.concatenate([np.full(len(ids), policy, dtype=bool) for ids, policy, *_ in pieces])
        token_step = np.concatenate([np.full(len(ids), step, dtype=np.int64) for ids, _, step, _ in pieces])
        logprobs = np.concatenate(
            [np.asarray(lp if policy else np.zeros(len(ids)), dtype=np.float32) for ids, policy, _, lp in pieces]
        )
        if ((input_ids < 0) | (input_ids >= self.tokenizer.vocab_size)).any():
            raise ValueError(
                f"trajectory {trajectory.prompt.id!r}: engine token ids outside the vocabulary "
                f"[0, {self.tokenizer.vocab_size})"
            )
        pads = int((input_ids == self.tokenizer.special.image_pad).sum())
        if pads != sum(p.num_tokens for p in images):
            raise ValueError(
                f"trajectory {trajectory.prompt.id!r}: {pads} image tokens in the ids but the "
                f"{len(images)} images need {sum(p.num_tokens for p in images)} "
                f"(the policy generated <|image_pad|>?)"
            )
        return RenderedSequence(input_ids, loss_mask, token_step, logprobs, images)
