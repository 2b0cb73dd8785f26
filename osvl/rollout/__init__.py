"""Rollouts: engines (local torch with a KV cache, SGLang and vLLM over HTTP), the ReAct agent loop,
grouped streaming with deadlines and retries (in the caller's process or in worker processes),
engine server processes, weight sync, logprob parity, the recorder, the reserved vision ids no
engine output may carry, and asynchronous GRPO's rollout generator and replay buffer
(``osvl.rollout.generator``, ``osvl.rollout.replay``). The SGLang-protocol loopback server
(``osvl.rollout.loopback``) runs as its own process (``python -m osvl.rollout.loopback``), so it is
not imported here."""

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
from osvl.rollout.engine_process import ProcessEngine, ProcessEngineConfig
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.rollout.parity import ParityReport, logprob_parity, trainer_logprobs
from osvl.rollout.recorder import RolloutRecorder
from osvl.rollout.reserved import UnusableToken, find_unusable, reserved_vision_ids
from osvl.rollout.sglang import SGLangConfig, SGLangEngine
from osvl.rollout.vllm import VLLMConfig, VLLMEngine
from osvl.rollout.worker_pool import (
    RolloutSetup,
    RolloutWorkerPool,
    WorkerPoolConfig,
    WorkerPoolStats,
)
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
    "ProcessEngine",
    "ProcessEngineConfig",
    "ReplayEngine",
    "RolloutMetrics",
    "RolloutRecorder",
    "RolloutSetup",
    "RolloutWorkerConfig",
    "RolloutWorkerPool",
    "SGLangConfig",
    "SGLangEngine",
    "SamplingParams",
    "StopKind",
    "UnusableToken",
    "VLLMConfig",
    "VLLMEngine",
    "WorkerPoolConfig",
    "WorkerPoolStats",
    "derive_seed",
    "find_unusable",
    "logprob_parity",
    "malformed_step",
    "parse_action",
    "reserved_vision_ids",
    "run_group",
    "run_trajectory",
    "stream_groups",
    "trainer_logprobs",
]
