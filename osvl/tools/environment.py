"""The agent-facing tool environment: one model action in, one typed ``ToolResult`` out.

Parsing, validation and image references are resolved here in the caller's process (cheap, and
a bad call never costs a worker round trip); the work runs in the pool; images the tool produced
join the trajectory's visual context and the observation text names their new indices.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from osvl.rl.trajectory import ToolCall, ToolResult, ToolStatus
from osvl.tools.cache import ToolCache
from osvl.tools.errors import CallParseError, ToolError, error_status
from osvl.tools.pool import Job
from osvl.tools.registry import ToolRegistry, parse_tool_call
from osvl.tools.visual_context import VisualContext

RawCall = str | Mapping[str, Any] | ToolCall


@dataclass(frozen=True)
class CallIdentity:
    """Which tool call of a rollout step this is; stable across reruns however calls interleave."""

    group_id: int
    sample_index: int
    turn: int


# Set by the agent loop around each tool call, so a wrapper of the runner (the fault injector of
# osvl.tools.faults) keys its decisions on which call it is, not on when it finishes.
current_call: ContextVar[CallIdentity | None] = ContextVar("osvl_current_tool_call", default=None)


class ToolRunner(Protocol):
    """What executes jobs: a local ``ToolPool`` or a ``RemoteToolPool``."""

    def call(self, job: Job) -> ToolResult: ...

    async def acall(self, job: Job) -> ToolResult: ...


class ToolEnvironment:
    def __init__(self, registry: ToolRegistry, pool: ToolRunner, cache: ToolCache | None = None) -> None:
        self.registry = registry
        self.pool = pool
        self.cache = cache

    def prepare(
        self, raw: RawCall, context: VisualContext, deadline_s: float | None = None, end_to_end_s: float | None = None
    ) -> Job | ToolResult:
        """A job ready for the pool, or the ``parse_error``/``invalid_arguments``/``tool_error`` that stops
        the call here. ``deadline_s`` bounds the run; ``end_to_end_s``, when given, also the time queued."""
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        name = ""
        try:
            call = parse_tool_call(raw, self.registry.limits)
            name = call.name
            call = self.registry.parse(call)
            spec = self.registry.get(call.name)
            images = [context.resolve(call.arguments[arg]) for arg in spec.image_args]
        except (CallParseError, ToolError) as err:
            return ToolResult(status=error_status(err), tool=name or getattr(err, "tool", ""), error=str(err))
        return Job(
            tool=spec.name,
            target=spec.target,
            arguments=call.arguments,
            images=images,
            deadline_s=deadline_s or spec.deadline_s,
            options=dict(spec.options),
            end_to_end_s=end_to_end_s,
        )

    async def execute(
        self, raw: RawCall, context: VisualContext, deadline_s: float | None = None, end_to_end_s: float | None = None
    ) -> ToolResult:
        started = time.monotonic()
        job = self.prepare(raw, context, deadline_s, end_to_end_s)
        if isinstance(job, ToolResult):
            return job
        result = self._lookup(job)
        if result is None:
            result = await self.pool.acall(job)
            self._store(job, result)
        return self._finish(result, context, started)

    def execute_sync(
        self, raw: RawCall, context: VisualContext, deadline_s: float | None = None, end_to_end_s: float | None = None
    ) -> ToolResult:
        started = time.monotonic()
        job = self.prepare(raw, context, deadline_s, end_to_end_s)
        if isinstance(job, ToolResult):
            return job
        result = self._lookup(job)
        if result is None:
            result = self.pool.call(job)
            self._store(job, result)
        return self._finish(result, context, started)

    def _cacheable(self, job: Job) -> bool:
        return self.cache is not None and self.registry.get(job.tool).cacheable

    def _lookup(self, job: Job) -> ToolResult | None:
        if not self._cacheable(job):
            return None
        hit = self.cache.lookup(job.tool, job.arguments, job.images)
        if hit is None and self.cache.mode == "replay":
            return ToolResult(
                status=ToolStatus.INFRA_ERROR,
                tool=job.tool,
                error=f"replay cache has no recorded result for this {job.tool} call",
            )
        return hit

    def _store(self, job: Job, result: ToolResult) -> None:
        if self._cacheable(job):
            self.cache.store(job.tool, job.arguments, job.images, result)

    @staticmethod
    def _finish(result: ToolResult, context: VisualContext, started: float) -> ToolResult:
        result.elapsed_s = time.monotonic() - started
        cap = context.limits.max_observation_chars
        if len(result.text) > cap:  # a runaway page or OCR dump must not flood the policy's context
            result.text = f"{result.text[:cap]}\n[truncated {len(result.text) - cap} characters]"
        if not result.ok or not result.images:
            return result
        limit = context.limits.max_image_pixels
        for image in result.images:
            if image.shape[0] * image.shape[1] > limit:
                return ToolResult(
                    status=ToolStatus.TOOL_ERROR,
                    tool=result.tool,
                    elapsed_s=result.elapsed_s,
                    error=f"the result is {image.shape[1]}x{image.shape[0]} pixels, over the limit "
                    f"of {limit}; crop or downscale the input first",
                )
        if len(context) + len(result.images) > context.limits.max_context_images:
            return ToolResult(
                status=ToolStatus.TOOL_ERROR,
                tool=result.tool,
                elapsed_s=result.elapsed_s,
                error=f"the visual context holds {len(context)} images and cannot take "
                f"{len(result.images)} more (limit {context.limits.max_context_images})",
            )
        indices = [context.append(image) for image in result.images]
        noun = "image" if len(indices) == 1 else "images"
        note = f"New {noun} at index {', '.join(map(str, indices))}."
        result.text = f"{result.text}\n{note}" if result.text else note
        return result
