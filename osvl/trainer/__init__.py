"""Training stages (SFT, GRPO), checkpoints, metrics and reports."""

from osvl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from osvl.trainer.grpo import run_grpo
from osvl.trainer.loss import sft_loss
from osvl.trainer.metrics import MetricsWriter, progress_line, read_metrics
from osvl.trainer.optim import build_optimizer, build_scheduler, lr_factor
from osvl.trainer.sft import StageResult, run_sft

__all__ = [
    "MetricsWriter", "StageResult", "build_optimizer", "build_scheduler", "latest_checkpoint", "load_checkpoint",
    "lr_factor", "progress_line", "read_metrics", "run_grpo", "run_sft", "save_checkpoint", "sft_loss",
]
