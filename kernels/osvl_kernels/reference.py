"""Float64 reference of the fused GRPO loss: the executable specification.

Written for clarity, independently of the fast paths (python loops over sequences and groups,
autograd for gradients), so that tests compare two implementations rather than one with itself.
Every backend must match it; nothing on a hot path calls it.
"""

from __future__ import annotations

import math

import torch

from osvl_kernels.loss_config import GRPOLossConfig, resolve_loss_config


def reference_advantages(
    rewards: list[float],
    group_ids: list[int],
    is_fatal: list[bool],
    *,
    estimator: str = "grpo",
    std: str = "unbiased",
    eps: float = 1e-6,
    clamp_fatal: bool = True,
) -> list[float]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        n = len(idx)
        if n == 1:
            continue
        values = [rewards[i] for i in idx]
        mean = sum(values) / n
        for i in idx:
            if estimator == "drgrpo":
                out[i] = rewards[i] - mean
            elif estimator == "rloo":
                out[i] = rewards[i] - (sum(values) - rewards[i]) / (n - 1)
            elif estimator == "grpo":
                dof = n - 1 if std == "unbiased" else n
                sd = math.sqrt(sum((v - mean) ** 2 for v in values) / dof)
                out[i] = (rewards[i] - mean) / (sd + eps)
            else:
                raise ValueError(estimator)
    if clamp_fatal:
        out = [max(a, 0.0) if f else a for a, f in zip(out, is_fatal)]
    return out


def reference_grpo_loss(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    fatal_step: torch.Tensor | None = None,
    token_step: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    num_seqs: int | None = None,
    num_tokens: int | None = None,
    is_weights: torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
    **settings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, logprobs [T], advantages) in float64; `loss` is differentiable w.r.t. `logits`.

    The importance weight of a token (`is_weights`, or exp(old - behavior) of the token or of its
    whole sequence under `rollout_correction`, truncated or masked outside [low, high]) scales its
    clipped policy-gradient term only. Settings as in `grpo_loss` (the backend and validate do nothing here)."""
    c = resolve_loss_config("reference_grpo_loss", config, settings)
    eps_low, eps_high, dual_clip, temperature = c.eps_low, c.eps_high, c.dual_clip, c.temperature
    kl_coef, kl_max, kl_is_weighted, entropy_coef = c.kl_coef, c.kl_max, c.kl_is_weighted, c.entropy_coef
    loss_agg, max_response_len, rollout_correction = c.loss_agg, c.max_response_len, c.rollout_correction
    z = logits.to(torch.float64) / temperature
    T = z.shape[0]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    S = len(bounds) - 1
    fatal = [-1] * S if fatal_step is None else [int(x) for x in fatal_step.tolist()]
    is_fatal = [f >= 0 for f in fatal]

    if advantages is not None:
        adv = advantages.to(torch.float64)
        per_token_adv = adv.shape[0] == T and T != S
    else:
        adv = torch.tensor(
            reference_advantages(
                rewards.tolist(),
                group_ids.tolist(),
                is_fatal,
                estimator=c.estimator,
                std=c.std,
                eps=c.adv_eps,
                clamp_fatal=c.clamp_fatal,
            ),
            dtype=torch.float64,
            device=z.device,
        )
        per_token_adv = False

    def is_valid(i: int, t: int) -> bool:
        return bool(loss_mask[t]) and not (is_fatal[i] and int(token_step[t]) >= fatal[i])

    def capped_weight(log_ratio: float) -> float:
        w = math.exp(log_ratio)
        low = rollout_correction.low or 0.0
        if rollout_correction.mode == "truncate":
            return min(max(w, low), rollout_correction.high)
        return w if low <= w <= rollout_correction.high else 0.0

    token_is_weight = [1.0] * T
    if is_weights is not None:
        token_is_weight = [float(w) for w in is_weights.tolist()]
    elif behavior_logprobs is not None:
        for i in range(S):
            diffs = {}
            for t in range(bounds[i], bounds[i + 1]):
                if is_valid(i, t):
                    d = float(old_logprobs[t]) - float(behavior_logprobs[t])
                    diffs[t] = 0.0 if math.isnan(d) else d
            for t in diffs:
                log_ratio = sum(diffs.values()) if rollout_correction.level == "sequence" else diffs[t]
                token_is_weight[t] = capped_weight(log_ratio)

    logp_all = torch.log_softmax(z, dim=-1)
    probs = logp_all.exp()
    logprobs = torch.zeros(T, dtype=torch.float64, device=z.device)
    seq_sums: list[torch.Tensor] = []
    seq_counts: list[int] = []
    for i in range(S):
        total = z.new_zeros(())
        count = 0
        for t in range(bounds[i], bounds[i + 1]):
            if not is_valid(i, t):
                continue
            count += 1
            logp = logp_all[t, int(target_ids[t])]
            logprobs[t] = logp.detach()
            old = logp.detach() if old_logprobs is None else old_logprobs[t].to(torch.float64)
            ratio = torch.exp(logp - old)
            a = adv[t] if per_token_adv else adv[i]
            unclipped = -ratio * a
            clipped = -torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
            loss_t = torch.where(unclipped >= clipped, unclipped, clipped)
            if dual_clip is not None and float(a) < 0:
                cap = -dual_clip * a
                loss_t = torch.where(loss_t > cap, cap, loss_t)
            loss_t = token_is_weight[t] * loss_t
            if kl_coef:
                delta = ref_logprobs[t].to(torch.float64) - logp
                kl = torch.exp(delta) - delta - 1
                if kl_max is not None:
                    kl = torch.clamp(kl, max=kl_max)
                if kl_is_weighted:
                    kl = ratio * kl
                loss_t = loss_t + kl_coef * kl
            if entropy_coef:
                entropy = -(probs[t] * logp_all[t]).sum()
                loss_t = loss_t - entropy_coef * entropy
            total = total + loss_t
        seq_sums.append(total)
        seq_counts.append(count)

    S_norm = S if num_seqs is None else num_seqs
    if loss_agg == "token-mean":
        n_tok = sum(seq_counts) if num_tokens is None else num_tokens
        loss = sum(seq_sums) / max(n_tok, 1)
    elif loss_agg == "seq-mean-token-sum":
        loss = sum(seq_sums) / S_norm
    elif loss_agg == "seq-mean-token-mean":
        loss = sum(s / max(n, 1) for s, n in zip(seq_sums, seq_counts)) / S_norm
    elif loss_agg == "seq-mean-token-sum-norm":
        loss = sum(seq_sums) / (S_norm * max_response_len)
    elif loss_agg == "token-sum":
        loss = sum(seq_sums) + z.new_zeros(())
    else:
        raise ValueError(loss_agg)
    return loss, logprobs, adv


def reference_token_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of each row) at `temperature`, in float64."""
    logp_all = torch.log_softmax(logits.to(torch.float64) / temperature, dim=-1)
    logp = logp_all.gather(1, target_ids[:, None].long()).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy
