"""Host-side half of fatal-aware GRPO: trajectory records, fatal steps, rewards, advantages.

The torch-dependent names (advantages, statistics) load on first use, so tool and rollout worker
processes that only need the records (``from osvl.rl.trajectory import ToolResult``) stay light.
"""

from importlib import import_module
from typing import Any

from osvl.rl.chain import EvidenceChainQueryJudge
from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.rl.fatal import FatalConfig, find_fatal_step, has_infra_error, trajectory_fatal_step, valid_prefix
from osvl.rl.judges import LLMAccuracyJudge, LLMQueryJudge, Verdict
from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.rewards import RewardConfig, composite_reward, format_reward, score_batch, score_trajectory
from osvl.rl.trajectory import (
    FinishReason,
    Prompt,
    RewardParts,
    Step,
    ToolCall,
    ToolResult,
    ToolStatus,
    Trajectory,
    append_jsonl,
    read_jsonl,
)

_LAZY = {
    "AdvantageBatch": "osvl.rl.advantages",
    "AdvantageConfig": "osvl.rl.advantages",
    "compute_advantages": "osvl.rl.advantages",
    "trajectory_advantages": "osvl.rl.advantages",
    "BatchStats": "osvl.rl.stats",
    "batch_stats": "osvl.rl.stats",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'osvl.rl' has no attribute {name!r}")


__all__ = [
    "AdvantageBatch",
    "AdvantageConfig",
    "BatchStats",
    "ChatCompletionsClient",
    "ChatJudgeConfig",
    "EvidenceChainQueryJudge",
    "ExactMatchAccuracyJudge",
    "FatalConfig",
    "FinishReason",
    "HeuristicQueryJudge",
    "LLMAccuracyJudge",
    "LLMQueryJudge",
    "Prompt",
    "RewardConfig",
    "RewardParts",
    "Step",
    "ToolCall",
    "ToolResult",
    "ToolStatus",
    "Trajectory",
    "Verdict",
    "append_jsonl",
    "batch_stats",
    "compute_advantages",
    "composite_reward",
    "find_fatal_step",
    "format_reward",
    "has_infra_error",
    "read_jsonl",
    "score_batch",
    "score_trajectory",
    "trajectory_advantages",
    "trajectory_fatal_step",
    "valid_prefix",
]
