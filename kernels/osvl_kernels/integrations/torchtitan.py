"""torchtitan (0.3.0) adapter: `OsvlGRPOLoss`, a `BaseLoss` for torchtitan's RL trainer.

It takes the RL trainer's call exactly (`loss_fn(pred, labels, global_valid_tokens,
generator_logprobs=, advantages=, loss_mask=)`, plus `positions=` when given) on torchtitan's packed
rows ([B, L], positions restart at 0 per sample) and runs `grpo_loss` on them: one fused pass
instead of log_softmax + gather + a separate backward. Select it in a config with
`loss=OsvlGRPOLoss.Config(eps_low=0.2, eps_high=0.28)`; like torchtitan's DAPOLoss, the scalar is
the sum of per-token losses / `global_valid_tokens`, so gradient accumulation and DP match one big
batch, and it composes with `ChunkedLossWrapper` (chunks along L carry their own positions).

This module imports torchtitan; `import osvl_kernels` does not import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import BaseLoss
from torchtitan.config import CompileConfig

from osvl_kernels.grpo_loss import grpo_loss


def packed_cu_seqlens(shape: tuple[int, int], positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Sequence boundaries of torchtitan's packed rows: a new sequence wherever positions == 0,
    and at every row start. Without positions each row is one sequence."""
    B, L = shape
    starts = torch.zeros(B, L, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if positions is not None:
        if positions.shape != (B, L):
            raise ValueError(f"positions must be [{B}, {L}], got {tuple(positions.shape)}")
        starts |= positions.to(device) == 0
    begin = starts.reshape(-1).nonzero().squeeze(1)
    end = torch.tensor([B * L], device=device)
    return torch.cat([begin, end]).to(torch.int32)


class OsvlGRPOLoss(BaseLoss):
    """Clipped (optionally dual-clipped) GRPO surrogate with osvl semantics on packed rows."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        eps_low: float = 0.2
        """The ratio is clamped to >= 1 - eps_low."""
        eps_high: float = 0.28
        """The ratio is clamped to <= 1 + eps_high (DAPO clip-higher)."""
        dual_clip: float | None = None
        """Dual-clip cap for negative advantages (e.g. 3.0); None disables it."""
        entropy_coef: float = 0.0
        temperature: float = 1.0

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None) -> None:
        del compile_config  # the loss is a fused kernel already
        self.config = config

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | float | None = None,
        *,
        generator_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if logits.dim() != 3:
            raise ValueError(f"logits must be [B, L, V], got {tuple(logits.shape)}")
        B, L, V = logits.shape
        for name, x in (
            ("labels", labels),
            ("generator_logprobs", generator_logprobs),
            ("advantages", advantages),
            ("loss_mask", loss_mask),
        ):
            if x.shape != (B, L):
                raise ValueError(f"{name} must be [{B}, {L}], got {tuple(x.shape)}")
        # A non-finite generator log-prob has no old policy to compare with: drop the token (as DAPOLoss does).
        valid = loss_mask.bool() & torch.isfinite(generator_logprobs)
        old = torch.where(valid, generator_logprobs.float(), torch.zeros_like(generator_logprobs, dtype=torch.float32))
        denom = 1.0 if global_valid_tokens is None else global_valid_tokens
        if isinstance(denom, torch.Tensor):
            denom = denom.clamp_min(1)
        else:
            denom = max(denom, 1)
        cfg = self.config
        out = grpo_loss(
            logits.reshape(B * L, V),
            labels.reshape(-1),
            packed_cu_seqlens((B, L), positions, logits.device),
            valid.reshape(-1),
            old_logprobs=old.reshape(-1),
            advantages=advantages.reshape(-1).float(),
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            dual_clip=cfg.dual_clip,
            entropy_coef=cfg.entropy_coef,
            temperature=cfg.temperature,
            loss_agg="token-mean",
            num_tokens=denom,
        )
        m = out.metrics
        share = m["num_valid_tokens"].float() / denom  # local means -> sums over the global token count
        flat_valid = valid.reshape(-1)
        ratio = torch.exp(out.logprobs - old.reshape(-1))
        outside = (ratio - ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)).abs() > 1e-6
        metrics = {
            "loss/mean": out.loss.detach(),
            "loss/ratio_mean": m["ratio_mean"] * share,
            # torchtitan's meaning: the ratio left the clip range (whatever the advantage's sign)
            "loss/ratio_clipped_frac": (outside & flat_valid).sum() / denom,
            "loss/pg_clip_active_frac": m["clip_frac"] * share,
            "trainer/entropy/mean": m["entropy_mean"] * share,
        }
        return out.loss, metrics
