"""The agent's tool environment: seven tools in worker processes with hard deadlines.

``ToolEnvironment.execute`` turns one model action into a typed ``ToolResult``; images are
addressed by index into the trajectory's ``VisualContext``; ``tool_schemas()`` is what the
prompt renders.

The HTTP tool server (:mod:`osvl.tools.server`, ``ToolServer``) and its client
(:mod:`osvl.tools.client`, ``RemoteToolPool``) are imported from their modules: the package does not
import the server's ``__main__`` module, so ``python -m osvl.tools.server`` runs it once, without
runpy's warning.
"""

from osvl.tools.cache import CacheStats, ToolCache
from osvl.tools.catalog import builtin_specs, default_registry, tool_schemas
from osvl.tools.config import (
    HttpConfig,
    ImageSearchConfig,
    OcrConfig,
    SuperResolutionConfig,
    TextSearchConfig,
    ToolBackendsConfig,
)
from osvl.tools.environment import ToolEnvironment
from osvl.tools.errors import BackendError, CallParseError, InvalidArguments, ToolError
from osvl.tools.limits import ToolLimits
from osvl.tools.pool import Job, PoolBusy, PoolClosed, PoolConfig, PoolStats, ToolPool
from osvl.tools.profiles import ToolProfile, tool_profile
from osvl.tools.registry import ToolOutput, ToolRegistry, ToolSpec, parse_tool_call
from osvl.tools.visual_context import VisualContext

__all__ = [
    "BackendError",
    "CacheStats",
    "CallParseError",
    "HttpConfig",
    "ImageSearchConfig",
    "InvalidArguments",
    "Job",
    "OcrConfig",
    "PoolBusy",
    "PoolClosed",
    "PoolConfig",
    "PoolStats",
    "SuperResolutionConfig",
    "TextSearchConfig",
    "ToolBackendsConfig",
    "ToolCache",
    "ToolEnvironment",
    "ToolError",
    "ToolLimits",
    "ToolOutput",
    "ToolPool",
    "ToolProfile",
    "ToolRegistry",
    "ToolSpec",
    "VisualContext",
    "builtin_specs",
    "default_registry",
    "parse_tool_call",
    "tool_profile",
    "tool_schemas",
]
