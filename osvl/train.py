"""``torchrun --nproc_per_node N -m osvl.train --recipe NAME [--set key=value ...] [--dry-run]``

The recipe is loaded and validated before any process group starts, so a typo fails in a second
on every rank with the key path. ``--dry-run`` stops there and, for recipes with a target world
size (the paper recipes), runs the meta-device memory planner on a fake group of that size.

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


def dry_run(recipe: Recipe) -> list[str]:
    """Validation summary, plus the per-rank memory plan when the recipe names a world size."""
    lines = [f"recipe {recipe.job.name}: stage {recipe.job.stage}, model {recipe.model.preset}, "
             f"parallel {recipe.parallel}"]
    if recipe.job.world_size:
        from osvl.parallel.plan import plan

        report = plan(recipe.model.preset, world_size=recipe.job.world_size, parallel=recipe.parallel,
                      tokens_per_rank=recipe.data.max_tokens)
        lines += report.lines()
    else:
        lines.append("no job.world_size: the topology is whatever torchrun starts (tiny CPU recipe)")
    return lines


def main(argv: list[str] | None = None) -> int:
    die_with_torchrun_agent()
    from osvl.config import load_recipe

    parser = argparse.ArgumentParser(prog="python -m osvl.train", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="a name in recipes/ or a path to a .toml file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set grpo.eps_high=0.3 (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="validate and plan memory; start nothing")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.dry_run:
        if rank == 0:
            print("\n".join(dry_run(recipe)))
        return 0
    if recipe.job.world_size and recipe.job.world_size != world:
        parser.error(f"recipe {recipe.job.name} targets job.world_size={recipe.job.world_size} but "
                     f"{world} processes were started (use --set job.world_size={world} to run it smaller)")
    if recipe.job.stage == "grpo":
        from osvl.trainer.grpo import check_grpo_recipe

        try:
            check_grpo_recipe(recipe, recipe.data_parallel_size(world))
        except ValueError as error:
            parser.error(str(error))
    return _train(recipe, rank, world)


def _train(recipe: Recipe, rank: int, world: int) -> int:
    import torch.distributed as dist

    from osvl.parallel import teardown, use_host_device
    from osvl.parallel._compat import default_backend
    from osvl.trainer import run_grpo, run_sft
    from osvl.run_lock import RunDirError, own_run_dir

    use_host_device()
    if world > 1:
        dist.init_process_group(default_backend(), rank=rank, world_size=world)
    try:
        with own_run_dir(recipe.job.run_dir, rank, recipe.job.name):
            result = (run_grpo if recipe.job.stage == "grpo" else run_sft)(recipe, rank, world)
    except RunDirError as error:
        if rank == 0:
            print(f"python -m osvl.train: error: {error}", file=sys.stderr)
        return 2
    finally:
        teardown()
    if rank == 0:
        trained = "" if result.steps > result.resumed_from else " (already finished: nothing trained)"
        print(f"{recipe.job.name}: {result.steps} steps{trained}, final loss {result.final_loss:.4f}, "
              f"run dir {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
