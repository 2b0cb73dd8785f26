"""Rollouts: engines (local torch with a KV cache, SGLang over HTTP), the ReAct agent loop,
grouped streaming with deadlines and retries, weight sync, logprob parity and the recorder."""

from osvl.rollout.agent import Action, AgentConfig, parse_action, run_trajectory
from osvl.rollout.engine import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
    derive_seed,
)
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.rollout.loopback import LoopbackServer
from osvl.rollout.parity import ParityReport, logprob_parity, trainer_logprobs
from osvl.rollout.recorder import RolloutRecorder
from osvl.rollout.sglang import SGLangConfig, SGLangEngine
from osvl.rollout.workers import (
    Group,
    RolloutConfig,
    RolloutMetrics,
    is_stale,
    stream_groups,
)

__all__ = [
    "Action", "AgentConfig", "Engine", "EngineError", "GenerationRequest", "GenerationResult", "Group",
    "LocalEngine", "LoopbackServer", "ParityReport", "ReplayEngine", "RolloutConfig", "RolloutMetrics",
    "RolloutRecorder", "SGLangConfig", "SGLangEngine", "SamplingParams", "StopKind", "derive_seed", "is_stale",
    "logprob_parity", "parse_action", "run_trajectory", "stream_groups", "trainer_logprobs",
]
