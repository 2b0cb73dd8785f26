"""DCP checkpoints of the whole training state, so a resumed run continues the same stream.

``run_dir/checkpoints/step_00000012/``: model + optimizer as a distributed checkpoint (each rank
writes its shards), plus ``trainer_rank{r}.pt`` with the scheduler, the RNG states, the step and
the data cursor. A ``complete`` marker is written last; only marked checkpoints are resumed from.
The RNG states are restored by the stage right before its first step, after everything its start-up
draws (:meth:`osvl.trainer.stage.Stage.restore_rng`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from osvl.data.image import ImageConfig
from osvl.trainer.export import export_stage
from osvl.trainer.rng import rng_state

MARKER = "complete"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    return sorted(p for p in Path(root).glob("step_*") if (p / MARKER).is_file())


def latest_checkpoint(root: str | Path) -> Path | None:
    """Newest complete checkpoint under ``root`` (None when there is none)."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def discard_checkpoints_after(root: str | Path, step: int) -> list[str]:
    """Removes checkpoints of steps after ``step`` and every incomplete one (a save cut short);
    returns their directory names. Only the run directory's owner calls it, with no save under way."""
    removed = []
    for path in sorted(Path(root).glob("step_*")):
        try:
            at = int(path.name.removeprefix("step_"))
        except ValueError:
            continue
        if at > step or not (path / MARKER).is_file():
            shutil.rmtree(path)
            removed.append(path.name)
    return removed


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Collective: every rank calls it. ``trainer_state`` is this rank's (scheduler, cursor, ...)."""
    path = step_dir(Path(root), step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, path / f"trainer_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (path / MARKER).write_text(str(step))
        complete = sorted(p for p in Path(root).glob("step_*") if (p / MARKER).is_file())
        for old in complete[:-keep_last]:
            shutil.rmtree(old)
    _barrier()
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restores model and optimizer in place; returns this rank's trainer state (with ``step`` and ``rng``,
    the generators' states, which the stage sets once its start-up has drawn what it draws:
    :meth:`osvl.trainer.stage.Stage.restore_rng`)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER!r} marker)")
    state_file = path / f"trainer_rank{_rank()}.pt"
    if not state_file.is_file():
        raise ValueError(f"{state_file} is missing: was the checkpoint written with a different world size?")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(state_file, weights_only=False)


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Restores only the model's weights from a complete checkpoint, into any world size's plan (DCP reshards);
    the optimizer state and the trainer's files stay unread."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER!r} marker)")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])


@torch.no_grad()
def load_average(checkpoints: list[Path], model: torch.nn.Module) -> None:
    """The model's weights become the uniform mean of ``checkpoints``' (summed in float32, in checkpoint order); one
    checkpoint is read as it is, without the float32 copy of the shards a mean needs."""
    if len(checkpoints) == 1:
        load_model_weights(checkpoints[0], model)
        return
    total: dict[str, torch.Tensor] = {}
    for checkpoint in checkpoints:
        load_model_weights(checkpoint, model)
        for name, param in model.state_dict().items():
            if name in total:
                total[name] += param.float()
            else:
                total[name] = param.float().clone()
    for name, param in model.state_dict().items():
        param.copy_(total[name] / len(checkpoints))


def stage_state(scheduler: Stateful, stream: Stateful, **extra: Any) -> dict[str, Any]:
    """A stage's trainer state for ``save_checkpoint``: what ``resume_state`` restores, plus the
    stage's own ``extra`` keys."""
    return {"scheduler": scheduler.state_dict(), "cursor": stream.state_dict(), **extra}


def resume_state(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful,
    stream: Stateful,
    resume: bool = True,
) -> dict[str, Any]:
    """Continues from the newest complete checkpoint under ``root`` (when ``resume``): restores the
    model, optimizer, scheduler and data stream in place and returns the trainer state, whose
    ``step``, ``checkpoint`` (its path), ``rng`` and stage-specific keys the caller reads; ``{}`` means a
    fresh start."""
    latest = latest_checkpoint(root) if resume else None
    if latest is None:
        return {}
    state = load_checkpoint(latest, model, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["cursor"])
    return {**state, "checkpoint": str(latest)}


def finish_stage(
    save: Callable[[int], None],
    step: int,
    resumed: int,
    total: int,
    recipe: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    image_config: ImageConfig,
    run_dir: Path,
) -> None:
    """End-of-stage bookkeeping shared by the SFT and GRPO loops: a final checkpoint unless the
    loop has just written one, and the whole HF model directory (``osvl.trainer.export``: weights,
    tokenizer, chat template, generation and processor configs) once the stage ran to completion."""
    every = recipe.checkpoint.every_steps
    if step > resumed and not (every and step % every == 0):
        save(step)
    if step == total and recipe.checkpoint.export_hf:
        export_stage(recipe, model, tokenizer, image_config, run_dir / "hf")
