"""A tool environment that runs tools in the calling process: rollout worker processes in tests
get real tool semantics without spawning a tool pool each."""

from __future__ import annotations

import asyncio

from osvl.data.chat import ChatRenderer
from osvl.rl.trajectory import ToolResult
from osvl.tools import ToolBackendsConfig, ToolEnvironment, ToolRegistry
from osvl.tools.pool import Job
from osvl.tools.worker import run_job
from tests.rollout.helpers import IMAGE_CONFIG, tokenizer
from tests.tools.fault_tools import fault_specs


class InlineRunner:
    def __init__(self) -> None:
        self.config = ToolBackendsConfig()

    def call(self, job: Job) -> ToolResult:
        status, text, images, error = run_job(job.target, job.arguments, job.images, self.config)
        return ToolResult(status=status, tool=job.tool, text=text, images=images, error=error)

    async def acall(self, job: Job) -> ToolResult:
        return await asyncio.to_thread(self.call, job)


def inline_environment() -> ToolEnvironment:
    return ToolEnvironment(ToolRegistry(fault_specs()), InlineRunner())


def renderer_for(env: ToolEnvironment) -> ChatRenderer:
    """The renderer of the rollout tests (two schemas keep the tiny-BPE prompt short)."""
    shown = [env.registry.get(name).openai_schema() for name in ("echo", "echo_image")]
    return ChatRenderer(tokenizer(), IMAGE_CONFIG, shown)
