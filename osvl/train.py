"""``torchrun --nproc_per_node N -m osvl.train --recipe NAME [--set key=value ...] [--dry-run | --print-config]``

The recipe is loaded and validated before any process group starts, so a typo fails in a second
on every rank with the key path. ``--dry-run`` stops there: it runs the stage's own recipe checks
(the same function and messages as the stage), the meta-device memory planner on a fake group of
the recipe's world size (paper recipes), the serving plan (SGLang memory, weight-sync bytes) and every
path the recipe names (:mod:`osvl.trainer.inputs`); ``--preflight`` makes an unreadable input an error and
adds the probes of the servers, judges and tool servers the recipe names. A launch checks the inputs on
every rank before any process group starts: one line, exit 2.

A rank started by ``torchrun`` dies with its agent (:mod:`osvl.lifetime`), armed before the slow
imports; rank 0 owns the run directory for the whole stage (:mod:`osvl.run_lock`), so a
second job on it stops with the owner's host and pid.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from osvl.lifetime import die_with_torchrun_agent

if TYPE_CHECKING:
    from osvl.config import Recipe


def dry_run(recipe: Recipe, preflight: bool = False) -> list[str]:
    """The stage's own recipe checks, the per-rank memory plan when the recipe names a world size,
    the serving side (memory, weight-sync bytes), and with ``preflight`` the service probes."""
    from osvl.config.recipe import PAPER_PRESETS

    lines = [
        f"recipe {recipe.job.name}: stage {recipe.job.stage}, model {recipe.model.preset}, parallel {recipe.parallel}"
    ]
    recipe.check_stage(recipe.data_parallel_size(recipe.job.world_size or 1))
    if recipe.job.stage == "grpo":
        from osvl.serve.preflight import dry_run_lines

        lines += dry_run_lines(recipe)
    lines += _watchdog_lines(recipe)
    lines += _input_lines(recipe, strict=preflight)
    if recipe.job.world_size:
        lines += _memory_plan(recipe)
    else:
        lines.append("no job.world_size: the topology is whatever torchrun starts (tiny CPU recipe)")
    if recipe.job.stage == "grpo" and recipe.rollout.engine == "sglang" and recipe.model.preset in PAPER_PRESETS:
        from osvl.model.presets import preset
        from osvl.serve.plan import serving_plan

        lines += serving_plan(recipe, preset(recipe.model.preset)).lines()
    if preflight and recipe.job.stage == "grpo":
        lines += [f"pre-flight: {line}" for line in _check_services(recipe)]
    return lines


def _watchdog_lines(recipe: Recipe) -> list[str]:
    """The run's deadlines (osvl.trainer.watchdog) on the recipe's data-parallel size (2 ranks without one)."""
    from osvl.trainer.watchdog import collective_timeout_s, step_deadline_s

    dp = recipe.data_parallel_size(recipe.job.world_size or 2)
    lines = [f"watchdog: a collective fails after {collective_timeout_s(recipe, dp):.0f} s (job.collective_timeout_s)"]
    if recipe.job.stage == "grpo":
        lines.append(
            f"watchdog: a rank waits at most {step_deadline_s(recipe, dp):.0f} s for its step's groups, then every "
            "rank stops after a checkpoint (rollout.step_deadline_s)"
        )
    return lines


def _input_lines(recipe: Recipe, strict: bool) -> list[str]:
    """Each path the recipe names and whether it opens as it must; ``strict`` (the pre-flight): any that does not
    is an error. Without it the plan is still printed (data and weights that are not here yet)."""
    from osvl.trainer.inputs import check_inputs

    checks = check_inputs(recipe)
    problems = [check.line() for check in checks if check.problem]
    if problems and strict:
        raise ValueError(f"{len(problems)} of the recipe's inputs cannot be read: {'; '.join(problems)}")
    lines = [f"inputs: {check.line()}" for check in checks]
    if problems:
        lines.append(f"inputs: {len(problems)} cannot be read: a launch stops at start-up (exit 2)")
    return lines


def _check_services(recipe: Recipe) -> list[str]:
    """The GRPO stage's service probes that need no weights, on the stage's own inputs: its renderer,
    scorer, tool profile and first RL prompt."""
    from osvl.serve.preflight import check_services
    from osvl.trainer.grpo_data import load_prompts, stage_scorer
    from osvl.trainer.stage import stage_inputs
    from osvl.trainer.tool_env import recipe_profile

    _, arch, renderer = stage_inputs(recipe)
    tool_names = set(recipe_profile(recipe).registry.names)
    probe = load_prompts(recipe.data)[0] if recipe.rollout.engine in ("sglang", "vllm") else None
    scorer = stage_scorer(recipe)
    try:
        return check_services(recipe, arch, renderer, scorer, tool_names, probe)
    finally:
        scorer.close()


def _memory_plan(recipe: Recipe) -> list[str]:
    """The per-rank memory plan on a fake group of ``job.world_size`` ranks, with its fit verdict."""
    from osvl.model.presets import preset
    from osvl.parallel.plan import plan

    vision = preset(recipe.model.preset).vision
    d = recipe.data
    per_image = d.max_pixels // vision.patch_size**2
    images = recipe.rollout.max_turns + 1
    patches = d.max_patches or images * per_image
    chunk = recipe.grpo.loss_chunk if recipe.job.stage == "grpo" else recipe.sft.loss_chunk
    report = plan(
        recipe.model.preset,
        world_size=recipe.job.world_size,
        parallel=recipe.parallel,
        tokens_per_rank=d.max_tokens,
        patches_per_rank=patches,
        loss_chunk=chunk,
        stage=recipe.job.stage,
        gpu_memory_gib=recipe.job.gpu_memory_gib,
        host=_host_terms(recipe),
    )
    lines = report.lines()
    source = (
        "data.max_patches"
        if d.max_patches
        else f"assumed: {images} images (the prompt's and one per tool turn, rollout.max_turns) of "
        f"data.max_pixels {d.max_pixels} = {per_image} patches each"
    )
    lines.append(f"vision patches per micro-batch: {patches} ({source})")
    if recipe.job.stage == "grpo":
        g = recipe.grpo
        longest = g.max_prompt_tokens + g.max_response_tokens
        verdict = "fits" if longest <= d.max_tokens else "DOES NOT fit; the packer will refuse it"
        lines.append(
            f"longest trajectory: grpo.max_prompt_tokens + grpo.max_response_tokens = {longest} tokens "
            f"{verdict} in one micro-batch (data.max_tokens {d.max_tokens})"
        )
    return lines


def _host_terms(recipe: Recipe) -> dict:
    """What the host side of the memory plan depends on, from the recipe (and the checkpoint's config)."""
    import json
    from pathlib import Path

    sizes = {"bfloat16": 2, "float16": 2, "float32": 4}
    config = Path(recipe.model.pretrained) / "config.json" if recipe.model.pretrained else None
    stored = (
        json.loads(config.read_text()).get("torch_dtype", "bfloat16") if config and config.is_file() else "bfloat16"
    )
    r = recipe.rollout
    bucket = (
        0 if recipe.job.stage != "grpo" else (r.weight_sync_bucket_mb << 20 if r.weight_sync == "distributed" else None)
    )
    return {
        "pretrained": bool(recipe.model.pretrained),
        "stored_bytes": sizes.get(stored, 2),
        "export_bytes": sizes[recipe.checkpoint.export_dtype],
        "sync_bytes": sizes[recipe.parallel.param_dtype],
        "bucket_bytes": bucket,
    }


def main(argv: list[str] | None = None) -> int:
    die_with_torchrun_agent()
    from osvl.config import load_recipe

    parser = argparse.ArgumentParser(prog="python -m osvl.train", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="a name in osvl/recipes/ or a path to a .toml file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe value, e.g. --set grpo.eps_high=0.3 (repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate and plan memory; start nothing")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved recipe (defaults and overrides in place) as TOML that loads back; start nothing",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="with --dry-run: also probe the servers, judges and tool servers the recipe names",
    )
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.print_config:
        from osvl.config.loader import recipe_toml

        if rank == 0:
            print(recipe_toml(recipe), end="")
        return 0
    if args.dry_run:
        if rank == 0:
            try:
                print("\n".join(dry_run(recipe, args.preflight)))
            except ValueError as error:
                parser.error(str(error))
        return 0
    if recipe.job.world_size and recipe.job.world_size != world:
        parser.error(
            f"recipe {recipe.job.name} targets job.world_size={recipe.job.world_size} but "
            f"{world} processes were started (--set job.world_size={world} runs it on them; parallel.dp_shard=-1 "
            "follows the world, an explicit one must then fit: dp_replicate * dp_shard * tp = world)"
        )
    try:
        recipe.check_stage(recipe.data_parallel_size(world))
    except ValueError as error:
        parser.error(str(error))
    from osvl.trainer.inputs import input_problems
    from osvl.trainer.metrics import missing_trackers

    problems = input_problems(recipe)  # before any process group: every rank reads the same files and stops alike
    problems += missing_trackers(recipe.metrics.tensorboard, recipe.metrics.wandb, recipe.metrics.mlflow)
    if problems:
        if rank == 0:
            print(f"python -m osvl.train: error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    return _train(recipe, rank, world)


def _train(recipe: Recipe, rank: int, world: int) -> int:
    from datetime import timedelta

    from osvl.model import CheckpointError
    from osvl.parallel import start_rank, teardown
    from osvl.rollout.engine import EngineError
    from osvl.run_lock import RunDirError, own_run_dir
    from osvl.serve.preflight import PreflightError
    from osvl.step import NonFiniteGradient
    from osvl.trainer import run_grpo, run_sft
    from osvl.trainer.watchdog import RunStopped, collective_timeout_s

    start_rank(rank, world, timedelta(seconds=collective_timeout_s(recipe, recipe.data_parallel_size(world))))
    try:
        with own_run_dir(recipe.job.run_dir, rank, recipe.job.name):
            result = (run_grpo if recipe.job.stage == "grpo" else run_sft)(recipe, rank, world)
    except (RunDirError, CheckpointError, PreflightError, EngineError) as error:  # every rank stops alike
        if rank == 0:
            print(f"python -m osvl.train: error: {error}", file=sys.stderr)
        return 2
    except (RunStopped, NonFiniteGradient) as stopped:  # every rank together, after what could be saved
        if rank == 0:
            print(f"python -m osvl.train: stopped: {stopped}", file=sys.stderr)
        return 1
    finally:
        teardown()
    if rank == 0:
        trained = "" if result.steps > result.resumed_from else " (already finished: nothing trained)"
        print(
            f"{recipe.job.name}: {result.steps} steps{trained}, final loss {result.final_loss:.4f}, "
            f"run dir {result.run_dir}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
