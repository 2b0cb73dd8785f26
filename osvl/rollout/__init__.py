"""Rollouts: engines (local torch with a KV cache, SGLang and vLLM over HTTP), the ReAct agent loop,
grouped streaming with deadlines and retries, weight sync, logprob parity, the recorder, the
reserved vision ids no engine output may carry, and asynchronous GRPO's rollout generator and replay
buffer (``osvl.rollout.generator``, ``osvl.rollout.replay``). The SGLang-protocol stand-in server the
clients are tested against is a service: ``osvl.serve.loopback_engine``."""

from osvl.rollout.agent import (
    Action,
    AgentConfig,
    malformed_step,
    parse_action,
    run_trajectory,
)
from osvl.rollout.engine import (
    Engine,
    EngineError,
    GenerationPreempted,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopKind,
    derive_seed,
)
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.rollout.parity import ParityReport, logprob_parity, trajectory_logprobs
from osvl.rollout.recorder import RolloutRecorder
from osvl.rollout.reserved import UnusableToken, find_unusable, reserved_vision_ids
from osvl.rollout.sglang import SGLangConfig, SGLangEngine
from osvl.rollout.vllm import VLLMConfig, VLLMEngine
from osvl.rollout.workers import (
    Group,
    Preemption,
    RolloutMetrics,
    RolloutWorkerConfig,
    run_group,
    stream_groups,
)

__all__ = [
    "Action",
    "AgentConfig",
    "Engine",
    "EngineError",
    "GenerationPreempted",
    "GenerationRequest",
    "GenerationResult",
    "Group",
    "LocalEngine",
    "ParityReport",
    "Preemption",
    "ReplayEngine",
    "RolloutMetrics",
    "RolloutRecorder",
    "RolloutWorkerConfig",
    "SGLangConfig",
    "SGLangEngine",
    "SamplingParams",
    "StopKind",
    "UnusableToken",
    "VLLMConfig",
    "VLLMEngine",
    "derive_seed",
    "find_unusable",
    "logprob_parity",
    "malformed_step",
    "parse_action",
    "reserved_vision_ids",
    "run_group",
    "run_trajectory",
    "stream_groups",
    "trajectory_logprobs",
]
