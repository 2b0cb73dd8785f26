"""``[torchrun --nproc_per_node N -m] python -m osvl.export --recipe NAME [--set k=v ...] [--step S] --out DIR``

The HF model directory of any checkpoint step of a run (a stage writes one only when it finishes): the same
files as the stage's own ``run_dir/hf`` (weights in ``checkpoint.export_dtype``, tokenizer, chat template,
generation and processor configs). The recipe is the one the run was trained with (its ``job.run_dir``
names the run); ``--step`` defaults to the newest complete checkpoint. Each rank builds only its shards on
the recipe's parallel plan and reads its slices of the checkpoint, at any world size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def export_checkpoint(recipe, step: int | None, out: str | Path, rank: int = 0, world: int = 1) -> Path:
    """Writes ``out`` from checkpoint ``step`` of ``recipe``'s run (None: the newest); returns the checkpoint's path.
    Collective when ``world > 1``."""
    from osvl.trainer.checkpoint import latest_checkpoint, load_model_weights, step_dir
    from osvl.trainer.export import export_stage
    from osvl.trainer.policy import build_policy
    from osvl.trainer.stage import stage_inputs

    root = Path(recipe.job.run_dir) / "checkpoints"
    checkpoint = latest_checkpoint(root) if step is None else step_dir(root, step)
    if checkpoint is None:
        raise ValueError(f"no complete checkpoint under {root}")
    if not checkpoint.is_dir():
        done = sorted(p.name for p in root.glob("step_*"))
        raise ValueError(f"no checkpoint of step {step} under {root} (there: {', '.join(done) or 'none'})")
    tokenizer, arch, renderer = stage_inputs(recipe)
    model = build_policy(recipe, arch, world, fill=False)
    load_model_weights(checkpoint, model)
    export_stage(recipe, model, tokenizer, renderer.image_config, out)
    return checkpoint


def main(argv: list[str] | None = None) -> int:
    from osvl.config import load_recipe

    parser = argparse.ArgumentParser(prog="python -m osvl.export", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="the recipe the run was trained with (name or .toml path)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument("--out", required=True, help="the HF model directory to write")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    from osvl.parallel import start_rank, teardown

    start_rank(rank, world)
    try:
        checkpoint = export_checkpoint(recipe, args.step, args.out, rank, world)
    except ValueError as error:
        if rank == 0:
            print(f"python -m osvl.export: error: {error}", file=sys.stderr)
        return 2
    finally:
        teardown()
    if rank == 0:
        print(f"{args.out}: the HF model of {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
