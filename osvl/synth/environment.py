"""The real tools as a synthesis :data:`ToolExecutor`.

``EnvironmentTools`` adapts ``osvl.tools.ToolEnvironment`` (for a world:
:func:`osvl.tools.world.world_environment`) to the synthesis executor (one call plus the episode's
images in, a typed ``ToolResult`` out), so the scripted expert, the chat expert and the
staged-filter solvers run the same tools, worker pool and deadlines as RL rollouts: FTS5
TextSearch over ``corpus.jsonl``, pHash/ORB ImageSearch over ``images.jsonl``, rapidocr, the
repair tools.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from osvl.rl.trajectory import ToolCall, ToolResult, ToolStatus
from osvl.tools import ToolEnvironment, VisualContext


@dataclass
class EnvironmentTools:
    """A :data:`ToolExecutor` over a tool environment; a crashing environment is an ``infra_error``."""

    env: ToolEnvironment

    def __call__(self, call: ToolCall, images: list[np.ndarray]) -> ToolResult:
        try:
            context = VisualContext(images, self.env.registry.limits)
            return self.env.execute_sync(call, context)
        except Exception as error:  # noqa: BLE001 - errors are data: the episode records it and goes on
            return ToolResult(ToolStatus.INFRA_ERROR, call.name, error=f"tool environment failed: {error!r}")
