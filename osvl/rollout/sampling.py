"""Next-token sampling with per-request generators and the logprob of what was sampled."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    banned: torch.Tensor | None = None,
) -> tuple[int, float]:
    """One token from ``logits [V]``; returns (id, fp32 log_softmax(logits / T)[id]).

    ``temperature == 0`` is greedy and reports the logprob at T = 1. ``banned`` ids (reserved
    vision placeholders, padded vocabulary rows) get -inf before greedy, temperature and top-p, so
    they are never chosen. The logprob reported is that of the full tempered distribution, before
    the ban and before top-p truncation: the quantity the trainer recomputes.
    """
    logits = logits.float()
    allowed = logits if banned is None else logits.index_fill(0, banned, float("-inf"))
    if temperature == 0:
        token = int(torch.argmax(allowed))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = torch.softmax(allowed / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
