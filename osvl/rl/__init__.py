"""Host-side half of fatal-aware GRPO: trajectory records, fatal steps, rewards, advantages."""

from osvl.rl.advantages import AdvantageBatch, AdvantageConfig, compute_advantages, trajectory_advantages
from osvl.rl.fatal import FatalConfig, find_fatal_step, has_infra_error, trajectory_fatal_step, valid_prefix
from osvl.rl.judges import (
    ChatCompletionsClient,
    ChatJudgeConfig,
    ExactMatchAccuracyJudge,
    HeuristicQueryJudge,
    LLMAccuracyJudge,
    LLMQueryJudge,
    Verdict,
)
from osvl.rl.rewards import RewardConfig, composite_reward, format_reward, score_batch, score_trajectory
from osvl.rl.stats import BatchStats, batch_stats
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

__all__ = [
    "AdvantageBatch", "AdvantageConfig", "BatchStats", "ChatCompletionsClient", "ChatJudgeConfig",
    "ExactMatchAccuracyJudge", "FatalConfig", "FinishReason", "HeuristicQueryJudge",
    "LLMAccuracyJudge", "LLMQueryJudge", "Prompt", "RewardConfig", "RewardParts", "Step",
    "ToolCall", "ToolResult", "ToolStatus", "Trajectory", "Verdict", "append_jsonl",
    "batch_stats", "compute_advantages", "composite_reward", "find_fatal_step", "format_reward",
    "has_infra_error", "read_jsonl", "score_batch", "score_trajectory", "trajectory_advantages",
    "trajectory_fatal_step", "valid_prefix",
]
