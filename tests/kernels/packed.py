"""Random packed GRPO batches for kernel tests (sequences of varied length, fatal mixes)."""

from __future__ import annotations

import torch


def random_packed_batch(
    seed: int,
    *,
    num_seqs: int = 6,
    vocab: int = 61,
    max_len: int = 9,
    group_size: int = 3,
    fatal_frac: float = 0.4,
    num_steps: int = 4,
    dtype: torch.dtype = torch.float32,
    empty_seq: bool = False,
) -> dict:
    """A packed batch as `grpo_loss` takes it, plus `hidden`/`weight` for the fused-linear path."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=g)
    if empty_seq:
        lengths[num_seqs // 2] = 0
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    T = int(cu[-1])
    token_step = torch.cat(
        [torch.sort(torch.randint(0, num_steps, (int(n),), generator=g)).values for n in lengths]
    ).int()
    fatal = torch.where(
        torch.rand(num_seqs, generator=g) < fatal_frac,
        torch.randint(0, num_steps, (num_seqs,), generator=g),
        torch.full((num_seqs,), -1),
    ).int()
    logits = (torch.randn(T, vocab, generator=g) * 2.0).to(dtype)
    return dict(
        logits=logits,
        target_ids=torch.randint(0, vocab, (T,), generator=g),
        cu_seqlens=cu,
        loss_mask=torch.rand(T, generator=g) < 0.75,
        old_logprobs=-torch.rand(T, generator=g) * 4.0,
        ref_logprobs=-torch.rand(T, generator=g) * 4.0,
        rewards=torch.rand(num_seqs, generator=g).round(decimals=1),
        group_ids=torch.arange(num_seqs) // group_size,
        fatal_step=fatal,
        token_step=token_step,
        hidden=torch.randn(T, 16, generator=g),
        weight=torch.randn(vocab, 16, generator=g) * 0.5,
    )
