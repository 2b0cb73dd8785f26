"""GRPO batches: the prompt stream, each rank's share of it, and scored groups -> packed micro-batches.

Every rank rolls out its own slice of the step's prompts (whole groups, so a group never spans
ranks), then all ranks exchange the scored trajectories: advantages and batch statistics are
computed over the whole step, and every rank plans the same token-balanced packing.

Prompts come from osvl's prompts JSONL or a released verl-style parquet (``data.format``); rows
the parquet reader rejects are counted and logged, never fatal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from osvl.config.recipe import DataConfig, Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.formats import FileStats, iter_rl_parquet
from osvl.data.packing import (
    PackedBatch,
    PackingConfig,
    TrainSequence,
    pack_microbatch,
    pack_rank,
    plan_packing,
    train_sequence,
)
from osvl.data.vision_filler import with_grpo_filler
from osvl.rl.advantages import AdvantageBatch
from osvl.rl.chain import EvidenceChainQueryJudge
from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.rl.fatal import FatalConfig
from osvl.rl.judges import AccuracyJudge, LLMAccuracyJudge, LLMQueryJudge, QueryJudge
from osvl.rl.offline_judges import ExactMatchAccuracyJudge, HeuristicQueryJudge
from osvl.rl.rewards import RewardConfig
from osvl.rl.scoring import GroupScorer
from osvl.rl.trajectory import Prompt, Trajectory, read_prompts
from osvl.rollout import AgentConfig, RolloutWorkerConfig, SamplingParams
from osvl.trainer.sft_data import as_data_config, log_file_stats, resolve_format


def load_prompts(source: str | Path | DataConfig, stats: FileStats | None = None) -> list[Prompt]:
    """The RL prompts of ``data.train_path``; ``stats`` collects a parquet file's counts."""
    data = as_data_config(source)
    fmt = resolve_format(data, "grpo")
    path = Path(data.train_path)
    if fmt == "verl_parquet":
        stats = stats if stats is not None else FileStats(str(path))
        prompts = list(iter_rl_parquet(path, stats))
        log_file_stats(stats)
    else:
        prompts = list(read_prompts(path))
    if not prompts:
        rejected = f" ({dict(stats.rejected)} rejected: {stats.examples})" if stats and stats.rejected else ""
        raise ValueError(f"data.train_path: {path} holds no prompts{rejected}")
    missing = [p.id for p in prompts if not p.accepted_answers]
    if missing:
        raise ValueError(f"data.train_path: prompts without a reference answer cannot be scored: {missing[:3]}")
    return prompts


def recipe_fatal(recipe: Recipe) -> FatalConfig:
    """The fatal rule of ``grpo.fatal_k`` and ``grpo.fatal_errors``, shared by the agent loop and the scorer."""
    return FatalConfig(k=recipe.grpo.fatal_k, errors=recipe.grpo.fatal_errors)


def rollout_configs(
    recipe: Recipe,
    *,
    greedy: bool = False,
    group_size: int | None = None,
    max_retries: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
) -> tuple[AgentConfig, RolloutWorkerConfig]:
    """The agent loop and rollout workers of the recipe's GRPO stage. Evaluation reuses them with its
    own sampling (``greedy``: temperature 0, no top-p; or ``temperature`` / ``top_p``), group size and
    retry budget, so its prompts, tools and turn budget are the training ones."""
    g, r = recipe.grpo, recipe.rollout
    if greedy and (temperature is not None or top_p is not None):
        raise ValueError("greedy decoding takes no temperature or top_p")
    temperature = 0.0 if greedy else g.temperature if temperature is None else temperature
    top_p = 1.0 if greedy else g.top_p if top_p is None else top_p
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=g.max_response_tokens)
    agent = AgentConfig(
        max_turns=r.max_turns,
        max_total_tokens=g.max_prompt_tokens + g.max_response_tokens,
        sampling=sampling,
        fatal=recipe_fatal(recipe),
    )
    workers = RolloutWorkerConfig(
        group_size=g.group_size if group_size is None else group_size,
        max_in_flight=r.max_in_flight,
        trajectory_deadline_s=r.trajectory_deadline_s,
        max_retries=r.max_retries if max_retries is None else max_retries,
        base_seed=recipe.job.seed,
        infra_rollouts=g.infra_rollouts,
    )
    return agent, workers


def reward_scoring(recipe: Recipe) -> tuple[AccuracyJudge, QueryJudge, RewardConfig]:
    """The recipe's judges (offline, or LLM judges on ``judges.url``) and reward settings, shared by
    training and the demo's evaluation so both score a trajectory the same way."""
    j = recipe.judges
    client = None
    if "llm" in (j.accuracy, j.query):
        key = os.environ.get(j.api_key_env) if j.api_key_env else None
        client = ChatCompletionsClient(
            ChatJudgeConfig(
                base_url=j.url,
                model=j.model,
                api_key=key or None,
                timeout_s=j.timeout_s,
                max_attempts=j.max_attempts,
                overload_wait_s=j.overload_wait_s,
            )
        )
    accuracy = LLMAccuracyJudge(client) if j.accuracy == "llm" else ExactMatchAccuracyJudge()
    offline_query = EvidenceChainQueryJudge() if j.query == "chain" else HeuristicQueryJudge()
    query = LLMQueryJudge(client) if j.query == "llm" else offline_query
    return (
        accuracy,
        query,
        RewardConfig(alpha=j.alpha, fatal=recipe_fatal(recipe), infra_rollouts=recipe.grpo.infra_rollouts),
    )


def stage_scorer(recipe: Recipe) -> GroupScorer:
    """The GRPO stage's scorer: the recipe's judges behind a verdict cache and ``judges.max_concurrency`` threads."""
    accuracy, query, config = reward_scoring(recipe)
    return GroupScorer(
        accuracy, query, config, max_concurrency=recipe.judges.max_concurrency, cache_size=recipe.judges.cache_size
    )


def rank_share(batch: Sequence[int], dp_size: int, dp_rank: int) -> list[tuple[int, int]]:
    """(group id, prompt index) pairs this rank rolls out: a strided slice of the step's prompts."""
    if len(batch) % dp_size:
        raise ValueError(f"grpo.batch_prompts {len(batch)} must be a multiple of the data-parallel size {dp_size}")
    return [(g, batch[g]) for g in range(dp_rank, len(batch), dp_size)]


def training_sequences(
    trajectories: Sequence[Trajectory], advantages: AdvantageBatch, renderer: ChatRenderer
) -> list[TrainSequence]:
    """Kept trajectories, rendered from the engine's ids, with the mode's advantage and loss fatal step."""
    sequences = []
    for i, traj in enumerate(trajectories):
        if not bool(advantages.keep[i]) or not traj.steps:
            continue
        seq = train_sequence(traj, renderer, reward=traj.reward.total, advantage=float(advantages.advantages[i]))
        sequences.append(dataclasses.replace(seq, fatal_step=int(advantages.loss_fatal_steps[i])))
    return sequences


def rank_minibatch(
    sequences: Sequence[TrainSequence], max_tokens: int, dp_size: int, dp_rank: int, renderer: ChatRenderer
) -> tuple[list[PackedBatch], float]:
    """This rank's micro-batches of one mini-batch and the plan's padding fraction.

    Too few sequences for every rank (e.g. hard_mask dropped most of them) gives filler batches, so
    every rank still runs the same number of forwards.
    """
    if len(sequences) < dp_size:
        mine = [sequences[dp_rank]] if dp_rank < len(sequences) else []
        return [
            with_grpo_filler(pack_microbatch(mine, renderer.image_config, renderer.tokenizer.special), renderer)
        ], 0.0
    plan = plan_packing([s.num_tokens for s in sequences], PackingConfig(max_tokens=max_tokens, num_ranks=dp_size))
    batches = pack_rank(sequences, plan, dp_rank, renderer.image_config, renderer.tokenizer.special)
    return [with_grpo_filler(b, renderer) for b in batches], plan.padding_frac
