"""What the SFT and GRPO stages share: the policy and its optimizer, the data cursor, resume,
checkpoints, the metrics writer, per-step sums reduced once, and the result.

A stage is: ``stage_inputs`` (tokenizer, architecture, the prompt renderer), the stage's own
data, ``start_stage`` (model, optimizer, scheduler, resumed state), its loop, ``finish``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.distributed import rank_device
from osvl.data.tokenizer import Tokenizer, load_tokenizer
from osvl.model import Qwen3VLConfig, Qwen3VLModel
from osvl.trainer.checkpoint import finish_stage, latest_checkpoint, resume_state, save_checkpoint, stage_state
from osvl.trainer.flops import device_name, resolve_peak_tflops
from osvl.trainer.index_stream import IndexStream
from osvl.trainer.metrics import MetricsWriter, stage_metrics
from osvl.trainer.optim import build_optimizer, build_scheduler
from osvl.trainer.policy import build_policy, policy_arch, policy_renderer
from osvl.trainer.resume import Resumption, resume_records
from osvl.trainer.rng import set_rng_state


@dataclass(frozen=True)
class StageResult:
    steps: int  # optimizer steps (SFT) or rollout steps (GRPO) taken in total, including those before a resume
    resumed_from: int  # step of the checkpoint it resumed from; 0 = fresh start
    final_loss: float
    run_dir: Path


def stage_inputs(recipe: Recipe) -> tuple[Tokenizer, Qwen3VLConfig, ChatRenderer]:
    """The tokenizer, the policy's architecture and the renderer of the prompt both stages train on."""
    tokenizer = load_tokenizer(recipe.data.tokenizer or recipe.model.pretrained)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    return tokenizer, arch, policy_renderer(recipe, tokenizer, arch)


@dataclass
class Stage:
    recipe: Recipe
    rank: int
    world_size: int
    model: Qwen3VLModel
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stream: IndexStream
    total: int  # the stage's steps
    step: int  # steps taken (resumed ones included)
    resumed: int
    state: dict[str, Any]  # the resumed checkpoint's trainer state ({} on a fresh start)
    metrics: MetricsWriter
    peak_tflops: float | None
    resumption: Resumption  # what the relaunch resumed and discarded; its final_loss is the resumed step's
    extra_state: dict[str, Any] = field(default_factory=dict)  # saved with every checkpoint (e.g. policy_version)

    @property
    def run_dir(self) -> Path:
        return Path(self.recipe.job.run_dir)

    @property
    def dp_size(self) -> int:
        return self.recipe.data_parallel_size(self.world_size)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.recipe.parallel.tp

    def restore_rng(self) -> None:
        """The resumed checkpoint's generator states, set by the stage's loop right before its first step.
        Whatever the start-up draws (a generation copy of the policy built from random init, a probe)
        a fresh run drew too before its first step, so restoring only after it continues the
        uninterrupted run's streams exactly; restoring before would shift them by the start-up's draws."""
        if "rng" in self.state:
            set_rng_state(self.state["rng"])

    def save(self, at: int) -> None:
        """Collective DCP checkpoint of the whole training state at step ``at``."""
        save_checkpoint(
            self.run_dir / "checkpoints",
            at,
            self.model,
            self.optimizer,
            stage_state(self.scheduler, self.stream, **self.extra_state),
            keep_last=self.recipe.checkpoint.keep_last,
        )

    def maybe_save(self) -> None:
        every = self.recipe.checkpoint.every_steps
        if every and self.step % every == 0:
            self.save(self.step)

    def finish(self, tokenizer: Tokenizer, renderer: ChatRenderer, final_loss: float) -> StageResult:
        finish_stage(
            self.save,
            self.step,
            self.resumed,
            self.total,
            self.recipe,
            self.model,
            tokenizer,
            renderer.image_config,
            self.run_dir,
        )
        self.metrics.close()
        return StageResult(steps=self.step, resumed_from=self.resumed, final_loss=final_loss, run_dir=self.run_dir)


def will_resume(recipe: Recipe) -> bool:
    """Whether the stage continues from a checkpoint of its own (``checkpoint.resume`` and one in the run dir)."""
    return recipe.checkpoint.resume and latest_checkpoint(Path(recipe.job.run_dir) / "checkpoints") is not None


def start_stage(
    recipe: Recipe,
    rank: int,
    world_size: int,
    arch: Qwen3VLConfig,
    *,
    num_items: int,
    batch_size: int,
    max_steps: int,
    epochs: int,
    updates_per_step: int = 1,
) -> Stage:
    """The policy on its parallel plan, AdamW, the schedule over ``total * updates_per_step``
    updates, and the data cursor over ``num_items``; everything restored from the newest
    checkpoint in ``job.run_dir`` when ``checkpoint.resume``."""
    stream = IndexStream(num_items, batch_size, recipe.job.seed, recipe.data.shuffle)
    total = max_steps or epochs * stream.steps_per_epoch
    resuming = will_resume(recipe)
    model = build_policy(recipe, arch, world_size, fill=not resuming)  # a resume loads every weight itself
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, recipe.optimizer)
    scheduler = build_scheduler(optimizer, total * updates_per_step, recipe.scheduler)
    state = resume_state(
        Path(recipe.job.run_dir) / "checkpoints", model, optimizer, scheduler, stream, resume=recipe.checkpoint.resume
    )
    step = state.get("step", 0)
    resumption = resume_records(recipe, rank, state, total)  # cuts the dead attempt's records first; says so
    return Stage(
        recipe,
        rank,
        world_size,
        model,
        params,
        optimizer,
        scheduler,
        stream,
        total,
        step,
        step,
        state,
        stage_metrics(recipe, rank, resumed=bool(state)),
        resolve_peak_tflops(recipe.metrics.peak_tflops, device_name()),
        resumption,
    )


def all_reduce_max(values: Mapping[str, float]) -> dict[str, float]:
    """The largest value of each key over all ranks, in one collective (what every rank saw alike, e.g. a
    service's restart, counts once)."""
    keys = list(values)
    stacked = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=rank_device())
    if dist.is_initialized():
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return dict(zip(keys, stacked.tolist()))


def all_reduce_sums(values: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Sums every value over all ranks in one collective and one host read (float64)."""
    keys, device = list(values), rank_device()
    stacked = torch.stack(
        [
            v.detach().to(device=device, dtype=torch.float64).reshape(())
            if isinstance(v, torch.Tensor)
            else torch.tensor(float(v), dtype=torch.float64, device=device)
            for v in values.values()
        ]
    )
    if dist.is_initialized():
        dist.all_reduce(stacked)
    return dict(zip(keys, stacked.tolist()))
