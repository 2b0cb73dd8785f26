"""The per-token clipped policy-gradient objective and its derivative w.r.t. the token log-prob.

Pure fp32 math on [n]-sized tensors. The Triton kernel implements the same formulas inline; the
torch backends and the vocab-parallel path call these functions. Conventions (match reference.py):
  ratio  = exp(logp - old)              (old = logp itself when on-policy, so ratio = 1)
  l      = max(-ratio*A, -clip(ratio, 1-eps_low, 1+eps_high)*A)  (ties take the unclipped branch)
  dual   = for A < 0, l = min(l, -dual_clip*A)
  kl     = exp(ref - logp) - (ref - logp) - 1    (k3), then min(kl, kl_max) when kl_max is set
           (no gradient where clamped), then ratio*kl when kl_is_weighted
  loss_t = l + kl_coef*kl - entropy_coef*H
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osvl_kernels.loss_config import LossHyper


@dataclass
class TokenTerms:
    loss: torch.Tensor  # l + kl_coef*kl (the entropy term is added by the caller)
    dloss_dlogp: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the PPO clip bound was active
    dual_clipped: torch.Tensor  # bool: the dual-clip cap was active
    kl: torch.Tensor  # the KL term as it enters the loss (clamped, ratio-weighted when asked)


def token_terms(
    logp: torch.Tensor,
    advantage: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    hyper: LossHyper,
) -> TokenTerms:
    ratio = torch.ones_like(logp) if old_logp is None else torch.exp(logp - old_logp.float())
    unclipped = -ratio * advantage
    clipped_loss = -ratio.clamp(1.0 - hyper.eps_low, 1.0 + hyper.eps_high) * advantage
    use_unclipped = unclipped >= clipped_loss
    loss = torch.where(use_unclipped, unclipped, clipped_loss)
    dloss = torch.where(use_unclipped, unclipped, torch.zeros_like(unclipped))
    dual_clipped = torch.zeros_like(use_unclipped)
    if hyper.dual_clip is not None:
        cap = -hyper.dual_clip * advantage
        dual_clipped = (advantage < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
        dloss = torch.where(dual_clipped, torch.zeros_like(dloss), dloss)
    kl = torch.zeros_like(logp)
    if ref_logp is not None and hyper.kl_coef != 0.0:
        delta = ref_logp.float() - logp
        ratio_ref = torch.exp(delta)
        kl = ratio_ref - delta - 1.0
        dkl = 1.0 - ratio_ref
        if hyper.kl_max is not None:
            over = kl > hyper.kl_max
            kl = torch.where(over, torch.full_like(kl, hyper.kl_max), kl)
            dkl = torch.where(over, torch.zeros_like(dkl), dkl)
        if hyper.kl_is_weighted:  # d(ratio*kl)/dlogp = ratio*kl + ratio*dkl
            dkl = ratio * (kl + dkl)
            kl = ratio * kl
        loss = loss + hyper.kl_coef * kl
        dloss = dloss + hyper.kl_coef * dkl
    return TokenTerms(
        loss=loss, dloss_dlogp=dloss, ratio=ratio, clipped=~use_unclipped, dual_clipped=dual_clipped, kl=kl
    )
