"""A float64 reference of the MoE router losses, written from the textbook formulas (Switch
Transformer's fraction-times-probability balance loss, ST-MoE's z-loss) rather than from the code
under test."""

from __future__ import annotations

import torch


def layer_terms(x: torch.Tensor, gate: torch.Tensor, top_k: int, routed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(balance, z) of one layer on one micro-batch: ``x`` [T, D] router inputs, ``gate`` [E, D];
    only the first ``routed`` tokens count. balance = E * sum_e f_e * P_e with f_e the fraction of the
    routed token-slots that chose e and P_e the mean probability of e; z = mean logsumexp^2."""
    logits = x[:routed].double() @ gate.double().t()
    probs = torch.softmax(logits, dim=-1)
    experts = gate.shape[0]
    chosen = torch.zeros_like(probs)
    for token, row in enumerate(probs.topk(top_k, dim=-1).indices):
        chosen[token, row] = 1.0
    fraction = chosen.sum(0) / (routed * top_k)
    balance = experts * (fraction * probs.mean(0)).sum()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return balance, z


def top_k_margin(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability: routing is decided well above
    rounding error when it is large, so fp32 and fp64 choose the same experts."""
    probs = torch.softmax(x.detach().double() @ gate.detach().double().t(), dim=-1).sort(dim=-1, descending=True).values
    return float((probs[:, top_k - 1] - probs[:, top_k]).min())
