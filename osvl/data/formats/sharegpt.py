"""LLaMA-Factory ShareGPT files (the released SearchVL SFT set) -> osvl trajectories.

A record holds ``conversations`` (``{"from", "value"}`` turns: human, then assistant turns --
``gpt`` text with ``<think>``/``<tool_call>``/``<response>`` blocks, or a ``function_call`` turn
holding the call's JSON -- each tool call answered by an ``observation`` turn), ``images`` (paths,
absolute or relative to the dataset root), ``system`` and ``tools`` (a JSON string or list).
Every ``<image>`` placeholder, in any turn, takes the next path from ``images``: the ones in the
human turn are the question's, the ones in an observation are what that tool returned.

Steps come out text-only (no token ids), as SFT data has no engine; :func:`tokenize_steps`
tokenizes them for the renderer. Files stream: JSONL line by line, a JSON array object by object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from osvl.data.chat import function_schema
from osvl.data.formats.records import FileStats, Rejected, load_image_file
from osvl.data.tokenizer import Tokenizer
from osvl.rl.actions import parse_action
from osvl.rl.trajectory import (
    FinishReason,
    Prompt,
    Step,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
)

IMAGE_PLACEHOLDER = "<image>"
ERROR_PREFIX = "Tool execution error"  # how the release's tools word a failed call


@dataclass(frozen=True)
class ShareGPTColumns:
    """The ``columns`` and ``tags`` of a LLaMA-Factory ``dataset_info.json`` entry."""

    messages: str = "conversations"
    images: str = "images"
    system: str = "system"
    tools: str = "tools"
    role_tag: str = "from"
    content_tag: str = "value"
    user_tag: str = "human"
    assistant_tag: str = "gpt"
    function_tag: str = "function_call"
    observation_tag: str = "observation"
    system_tag: str = "system"


@dataclass
class SFTRecord:
    """One SFT example: the trajectory plus the system prompt and tool schema it was written for."""

    trajectory: Trajectory
    system: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)


def _parse_call(body: str, where: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        raise Rejected("bad tool call", f"{where}: not JSON ({err.msg})") from None
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str) or not call["name"]:
        raise Rejected("bad tool call", f"{where}: needs an object with a non-empty 'name'")
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise Rejected("bad tool call", f"{where}: arguments string is not JSON") from None
    if not isinstance(arguments, Mapping):
        raise Rejected("bad tool call", f"{where}: arguments must be an object")
    return ToolCall(call["name"], dict(arguments))


def _assistant_step(text: str, function_call: bool, where: str) -> Step:
    if function_call:
        call = _parse_call(text, where)
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return Step(token_ids=[], logprobs=[], text=f"<tool_call>\n{body}\n</tool_call>", tool_call=call)
    action = parse_action(text)
    if action.error is not None:
        raise Rejected("bad assistant turn", f"{where}: {action.error}")
    return Step(
        token_ids=[],
        logprobs=[],
        text=text,
        think=action.think,
        tool_call=_parse_call(action.call, where) if action.call is not None else None,
        response=action.response,
    )


def _tools(value: Any) -> list[dict[str, Any]]:
    if value in (None, ""):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise Rejected("bad tools", f"tools is not JSON ({err.msg})") from None
    if not isinstance(value, list):
        raise Rejected("bad tools", f"tools must be a list, got {type(value).__name__}")
    try:
        return [function_schema(tool) for tool in value]
    except ValueError as err:
        raise Rejected("bad tools", str(err)) from None


def sharegpt_record(
    raw: Any, record_id: str, image_root: str | os.PathLike[str], columns: ShareGPTColumns = ShareGPTColumns()
) -> SFTRecord:
    """One ShareGPT object -> an :class:`SFTRecord`; raises :class:`Rejected` with the reason."""
    if not isinstance(raw, Mapping):
        raise Rejected("not an object", f"got {type(raw).__name__}")
    turns = raw.get(columns.messages)
    if not isinstance(turns, list) or not turns:
        raise Rejected("no conversation", f"'{columns.messages}' must be a non-empty list")
    paths = raw.get(columns.images) or []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise Rejected("bad images", f"'{columns.images}' must be a list of paths")
    system = raw.get(columns.system) or ""
    if not isinstance(system, str):
        raise Rejected("bad system", "system must be a string")
    messages: list[tuple[str, str]] = []
    for turn in turns:
        if not isinstance(turn, Mapping) or not isinstance(turn.get(columns.content_tag), str):
            raise Rejected("bad turn", f"each turn needs a string '{columns.content_tag}'")
        messages.append((turn.get(columns.role_tag), turn[columns.content_tag]))
    if messages[0][0] == columns.system_tag:
        system = system or messages.pop(0)[1]
    placeholders = sum(text.count(IMAGE_PLACEHOLDER) for _, text in messages)
    if placeholders != len(paths):
        raise Rejected("image count mismatch", f"{placeholders} {IMAGE_PLACEHOLDER} placeholders, {len(paths)} images")
    loaded = iter([load_image_file(p, image_root) for p in paths])

    def take(text: str) -> tuple[str, list[np.ndarray]]:
        images = [next(loaded) for _ in range(text.count(IMAGE_PLACEHOLDER))]
        return text.replace(IMAGE_PLACEHOLDER, "").strip(), images

    if not messages or messages[0][0] != columns.user_tag:
        raise Rejected("bad role order", "the conversation must start with a user turn")
    question, prompt_images = take(messages[0][1])
    steps: list[Step] = []
    for index, (role, text) in enumerate(messages[1:], start=1):
        where = f"turn {index}"
        expect_assistant = index % 2 == 1
        if role in (columns.assistant_tag, columns.function_tag) and expect_assistant:
            if IMAGE_PLACEHOLDER in text:
                raise Rejected("image in assistant turn", f"{where}: the policy cannot emit images")
            steps.append(_assistant_step(text, role == columns.function_tag, where))
        elif role == columns.observation_tag and not expect_assistant:
            if steps[-1].tool_call is None:
                raise Rejected("bad role order", f"{where}: observation after a turn without a tool call")
            observation, images = take(text)
            status = ToolStatus.TOOL_ERROR if observation.startswith(ERROR_PREFIX) else ToolStatus.OK
            steps[-1].tool_result = ToolResult(
                status=status,
                tool=steps[-1].tool_call.name,
                text=observation,
                images=images,
                error=observation if status != ToolStatus.OK else None,
            )
            steps[-1].observation_text, steps[-1].observation_images = observation, images
        elif role == columns.user_tag:
            raise Rejected("multiple user turns", f"{where}: a trajectory has one question")
        else:
            raise Rejected("bad role order", f"{where}: unexpected role {role!r}")
    if not steps or steps[-1].response is None:
        raise Rejected("no final response", "the last assistant turn must hold a <response>")
    if any(step.tool_call is not None and step.tool_result is None for step in steps):
        raise Rejected("bad role order", "a tool call has no observation")
    record_id = str(raw.get("id", record_id))
    trajectory = Trajectory(
        prompt=Prompt(id=record_id, question=question, images=prompt_images),
        steps=steps,
        finish_reason=FinishReason.RESPONSE,
        group_id=0,
        sample_index=0,
    )
    return SFTRecord(trajectory, system, _tools(raw.get(columns.tools)))


def _json_objects(handle, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Objects of a top-level JSON array, or of JSON Lines, without loading the whole file."""
    decoder = json.JSONDecoder()
    buffer, position, eof, started = "", 0, False, False
    while True:
        while position < len(buffer) and buffer[position] in " \t\r\n,":
            position += 1
        if not started and position < len(buffer) and buffer[position] == "[":
            started, position = True, position + 1
            continue
        if position < len(buffer) and buffer[position] == "]":
            return
        try:
            value, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError as err:
            if eof:
                if position >= len(buffer):
                    return
                raise ValueError(f"malformed JSON at character {err.pos}: {err.msg}") from None
            chunk = handle.read(chunk_chars)
            eof = not chunk
            buffer, position = buffer[position:] + chunk, 0
            continue
        if end == len(buffer) and not eof:  # a number may continue in the next chunk
            chunk = handle.read(chunk_chars)
            eof = not chunk
            buffer, position = buffer[position:] + chunk, 0
            continue
        yield value
        started, position = True, end


def iter_sharegpt(
    path: str | os.PathLike[str],
    stats: FileStats | None = None,
    image_root: str | os.PathLike[str] | None = None,
    columns: ShareGPTColumns = ShareGPTColumns(),
    tokenizer: Tokenizer | None = None,
) -> Iterator[SFTRecord]:
    """Stream a ShareGPT ``.json`` (array) or ``.jsonl`` file; bad records are counted in ``stats``.

    Image paths resolve against ``image_root`` (default: the file's directory). With a tokenizer,
    ``stats.tokens`` counts the policy tokens :func:`tokenize_steps` would produce.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"ShareGPT file {path} does not exist")
    stats = stats if stats is not None else FileStats(str(path))
    root = Path(image_root) if image_root is not None else path.parent
    with open(path, encoding="utf-8") as handle:
        for index, raw in enumerate(_json_objects(handle)):
            try:
                record = sharegpt_record(raw, f"{path.stem}:{index}", root, columns)
            except Rejected as error:
                stats.reject(index, error)
                continue
            traj = record.trajectory
            stats.records += 1
            stats.turns += len(traj.steps)
            stats.tool_calls += sum(step.tool_call is not None for step in traj.steps)
            stats.images += len(traj.prompt.images) + sum(len(s.observation_images) for s in traj.steps)
            if tokenizer is not None:
                stats.tokens += sum(len(tokenizer.encode(step.text)) + 1 for step in traj.steps)
            yield record


def tokenize_steps(trajectory: Trajectory, tokenizer: Tokenizer, keep_token_ids: bool = False) -> Trajectory:
    """Give text-only steps token ids (text + ``<|im_end|>``, zero logprobs) for the renderer.

    The closing ``<|im_end|>`` belongs to the step so SFT teaches the policy to end its turn. A step
    that already has ids was recorded from an engine: ``keep_token_ids`` keeps it verbatim (osvl
    JSONL may mix both kinds); otherwise it is refused, as ShareGPT steps are text by construction.
    """
    steps = []
    for index, step in enumerate(trajectory.steps):
        where = f"trajectory {trajectory.prompt.id!r} step {index}"
        if step.token_ids:
            if not keep_token_ids:
                raise ValueError(f"{where} already has token ids; tokenize_steps is for text-only (SFT) steps")
            steps.append(step)
            continue
        if not step.text:
            raise ValueError(f"{where} has neither token ids nor text")
        ids = tokenizer.encode(step.text) + [tokenizer.special.im_end]
        steps.append(replace(step, token_ids=ids, logprobs=[0.0] * len(ids)))
    return replace(trajectory, steps=steps)
