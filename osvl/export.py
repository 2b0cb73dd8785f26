"""``[torchrun --nproc_per_node N -m] python -m osvl.export --recipe NAME [--set k=v ...] [--step S] --out DIR``

The HF model directory of any checkpoint step of a run (a stage writes one only when it finishes): the same
files as the stage's own ``run_dir/hf`` (weights in ``checkpoint.export_dtype``, tokenizer, chat template,
generation and processor configs). The recipe is the one the run was trained with (its ``job.run_dir``
names the run); ``--step`` defaults to the newest complete checkpoint. ``--average K`` writes the uniform
average of the newest K complete checkpoints instead (latest-weight averaging: a policy whose last steps still
wander between nearby solutions is often better, and less a matter of the draw, at their mean; the run must keep
them: ``checkpoint.keep_last >= K``). Each rank builds only its shards on the recipe's parallel plan and reads
its slices of the checkpoints, at any world size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def chosen_checkpoints(root: Path, step: int | None, average: int) -> list[Path]:
    """The checkpoint of ``step`` (None: the newest), or the newest ``average`` complete ones."""
    from osvl.trainer.checkpoint import complete_checkpoints, step_dir

    done = complete_checkpoints(root)
    there = ", ".join(p.name for p in done) or "none"
    if average:
        if step is not None:
            raise ValueError("--average takes the newest checkpoints; it does not combine with --step")
        if average > len(done):
            raise ValueError(f"--average {average}: {len(done)} complete checkpoint(s) under {root} ({there})")
        return done[-average:]
    if step is None:
        if not done:
            raise ValueError(f"no complete checkpoint under {root}")
        return [done[-1]]
    if not step_dir(root, step).is_dir():
        raise ValueError(f"no checkpoint of step {step} under {root} (there: {there})")
    return [step_dir(root, step)]


def export_checkpoint(
    recipe, step: int | None, out: str | Path, rank: int = 0, world: int = 1, average: int = 0
) -> list[Path]:
    """Writes ``out`` from checkpoint ``step`` of ``recipe``'s run (None: the newest), or from the mean of its newest
    ``average`` checkpoints; returns the checkpoints' paths. Collective when ``world > 1``."""
    from osvl.trainer.checkpoint import load_average
    from osvl.trainer.export import export_stage
    from osvl.trainer.policy import build_policy
    from osvl.trainer.stage import stage_inputs

    checkpoints = chosen_checkpoints(Path(recipe.job.run_dir) / "checkpoints", step, average)
    tokenizer, arch, renderer = stage_inputs(recipe)
    model = build_policy(recipe, arch, world, fill=False)
    load_average(checkpoints, model)
    export_stage(recipe, model, tokenizer, renderer.image_config, out)
    return checkpoints


def main(argv: list[str] | None = None) -> int:
    from osvl.config import load_recipe

    parser = argparse.ArgumentParser(prog="python -m osvl.export", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="the recipe the run was trained with (name or .toml path)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument(
        "--average", type=int, default=0, metavar="K", help="write the mean of the newest K complete checkpoints"
    )
    parser.add_argument("--out", required=True, help="the HF model directory to write")
    args = parser.parse_args(argv)
    if args.average < 0:
        parser.error(f"--average takes a count of checkpoints, got {args.average}")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    from osvl.parallel import start_rank, teardown

    start_rank(rank, world)
    try:
        checkpoints = export_checkpoint(recipe, args.step, args.out, rank, world, args.average)
    except ValueError as error:
        if rank == 0:
            print(f"python -m osvl.export: error: {error}", file=sys.stderr)
        return 2
    finally:
        teardown()
    if rank == 0:
        source = checkpoints[0] if len(checkpoints) == 1 else f"the mean of {', '.join(p.name for p in checkpoints)}"
        print(f"{args.out}: the HF model of {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
