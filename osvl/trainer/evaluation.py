"""A checkpoint's evaluation, as ``python -m osvl.demo evaluate`` and the fatal-mode ablation
(``osvl.study``) run it: the prompts of ``data.train_path`` rolled out under the GRPO stage's prompt,
tools and turn budget from an HF checkpoint (or the seeded initialization), scored as in training
(:mod:`osvl.trainer.validation` collects and sums the rollouts, as for in-training validation), and
summarised as Pass@1 (or pass@k) with each prompt's result for paired comparisons.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from osvl.config.recipe import Recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.eval.interval import pass_at_k
from osvl.model import build_model
from osvl.rl.chain import chain_progress
from osvl.rl.rewards import score_batch
from osvl.rl.trajectory import Trajectory, append_jsonl
from osvl.rollout import LocalEngine
from osvl.trainer.grpo_data import load_prompts, reward_scoring, rollout_configs
from osvl.trainer.policy import build_policy, policy_arch, policy_renderer
from osvl.trainer.tool_env import stage_environment
from osvl.trainer.validation import collect_rollouts, summary_means, summary_sums


def evaluation_rollouts(
    recipe: Recipe,
    checkpoint: str,
    limit: int = 0,
    engine_wrapper: Callable | None = None,
    samples: int = 0,
    faults: bool = False,
) -> list[Trajectory]:
    """Greedy rollouts of a policy on ``data.train_path``'s prompts under the GRPO stage's prompt,
    tools and turn budget, scored as in training; with ``samples`` > 0, that many rollouts a prompt at
    the GRPO stage's temperature and top-p instead (for pass@k). Faults and outages are off unless
    ``faults``: then the recipe's injected ones strike, as in training, on the same calls for every
    checkpoint (each decision is fixed by the job seed and the call's prompt, sample and turn).

    ``checkpoint`` is an HF directory, or ``init`` for the recipe's seeded initialization (what
    the SFT stage starts from).
    """
    pretrained = "" if checkpoint == "init" else checkpoint
    recipe = dataclasses.replace(
        recipe,
        model=dataclasses.replace(recipe.model, pretrained=pretrained),
        tools=recipe.tools if faults else dataclasses.replace(recipe.tools, fault_rate=0.0, outage_rate=0.0),
    )
    tokenizer = load_tokenizer(recipe.data.tokenizer or pretrained)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    renderer = policy_renderer(recipe, tokenizer, arch)
    prompts = load_prompts(recipe.data)
    prompts = prompts[:limit] if limit else prompts
    engine_model = build_model(arch, init=False)
    with torch.no_grad():
        engine_model.load_state_dict(build_policy(recipe, arch, world_size=1).state_dict())
    engine = LocalEngine(engine_model, tokenizer, renderer.image_config, max_batch=recipe.rollout.max_in_flight)
    engine = engine_wrapper(engine) if engine_wrapper else engine  # tests script the policy
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    agent, workers = rollout_configs(recipe, greedy=not samples, group_size=max(samples, 1), max_retries=0)
    with stage_environment(recipe, 0) as env:
        trajectories = asyncio.run(collect_rollouts(prompts, engine, env, renderer, agent, workers))
    order = {p.id: i for i, p in enumerate(prompts)}
    scored = score_batch(trajectories, *reward_scoring(recipe))
    return sorted(scored, key=lambda t: (order[t.prompt.id], t.sample_index))


def prompt_lookups(trajectories: Sequence[Trajectory]) -> dict[str, list[list[int]]]:
    """Each chain question's ``[issued, asked]`` lookups (:func:`osvl.rl.chain.chain_progress`), one pair per
    rollout in the given order: whether a policy looked each value up, prompt by prompt, for paired comparisons
    of the lookup rate."""
    lookups: dict[str, list[list[int]]] = {}
    for t in trajectories:
        if (progress := chain_progress(t.prompt.question, t.steps)) is not None:
            lookups.setdefault(t.prompt.id, []).append(list(progress))
    return lookups


def chain_breaks(lookups: dict[str, list[list[int]]]) -> dict:
    """Where the rollouts of chain questions stopped following their evidence, from :func:`prompt_lookups`:
    ``rollouts`` counts those rollouts, ``broken_at[i]`` those whose i-th lookup (1-based) was never issued on
    the entity the evidence named, ``complete`` those that issued every lookup."""
    progress = [pair for pairs in lookups.values() for pair in pairs]
    broken = Counter(done + 1 for done, asked in progress if done < asked)
    return {
        "rollouts": len(progress),
        "complete": sum(done == asked for done, asked in progress),
        "broken_at": {str(lookup): count for lookup, count in sorted(broken.items())},
    }


def evaluate_policy(
    recipe: Recipe,
    checkpoint: str,
    limit: int = 0,
    engine_wrapper: Callable | None = None,
    samples: int = 0,
    rollouts: str | Path | None = None,
    faults: bool = False,
) -> dict:
    """Greedy Pass@1 summary of :func:`evaluation_rollouts`, so before/after numbers differ only by the
    weights, with each prompt's accuracy (``per_prompt``, for paired comparisons) and where chains broke
    (``chains``, :func:`chain_breaks`); with ``samples`` = n, the means are over all n x prompts rollouts,
    ``per_prompt`` holds each prompt's n accuracies and ``pass_at_k`` the unbiased pass@k for every k <= n.
    ``anchors`` and ``hops`` map each prompt that carries them to its anchor entity and hop count; ``lookups``
    each chain question to ``[issued, asked]`` lookups (:func:`osvl.rl.chain.chain_progress`; with ``samples``,
    one pair per sample).
    ``rollouts``: a JSONL file (replaced) that receives every scored rollout, its images in ``images/``
    beside it, for reading what the policy did (:func:`osvl.rl.trajectory.read_jsonl`). ``faults``: with
    the recipe's injected tool faults (``tool_faults`` in the result says which rates struck)."""
    if rollouts is not None and Path(rollouts).is_dir():  # before the rollouts, not after them
        raise ValueError(f"rollouts: {rollouts} is a directory; give a JSONL file path")
    started = time.perf_counter()
    scored = evaluation_rollouts(recipe, checkpoint, limit, engine_wrapper, samples, faults)
    if rollouts is not None:
        Path(rollouts).unlink(missing_ok=True)
        append_jsonl(rollouts, scored)
    statuses = Counter(s.tool_result.status.value for t in scored for s in t.steps if s.tool_result is not None)
    sums = summary_sums(scored)
    per_prompt: dict[str, list[float | None]] = {}
    for t in scored:
        per_prompt.setdefault(t.prompt.id, []).append(t.reward.acc if t.reward is not None else None)
    lookups = prompt_lookups(scored)
    result = {
        "checkpoint": checkpoint,
        "prompts": len(per_prompt),
        "samples": samples,
        "scored": int(sums["scored"]),
        **summary_means(sums),
        "tool_statuses": dict(statuses),
        "tool_faults": {
            "fault_rate": recipe.tools.fault_rate if faults else 0.0,
            "outage_rate": recipe.tools.outage_rate if faults else 0.0,
        },
        "chains": chain_breaks(lookups),
        "wall_s": time.perf_counter() - started,
    }
    prompts = {t.prompt.id: t.prompt for t in scored}
    result["anchors"] = {p: prompt.anchor for p, prompt in prompts.items() if prompt.anchor}
    result["hops"] = {p: prompt.hops for p, prompt in prompts.items() if prompt.hops}
    if samples:
        result["temperature"], result["top_p"] = recipe.grpo.temperature, recipe.grpo.top_p
        result["pass_at_k"] = {str(k): pass_at_k(per_prompt.values(), k) for k in range(1, samples + 1)}
        result["per_prompt"], result["lookups"] = per_prompt, lookups
    else:
        result["per_prompt"] = {prompt: accs[0] for prompt, accs in per_prompt.items()}
        result["lookups"] = {prompt: pairs[0] for prompt, pairs in lookups.items()}
    return result
