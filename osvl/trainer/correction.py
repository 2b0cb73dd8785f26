"""The rollout-training mismatch of the GRPO stage: how far the trainer's old policy is from the engine's.

Engines and trainers compute log-probs with different kernels (and, with ``rollout.max_staleness
> 0``, a group may come from older weights), so the engine's log-probs are the *behaviour*
policy, not the trainer's old policy. With ``grpo.old_logprobs = "trainer"`` the stage recomputes
the old policy's log-probs with a no-grad forward of its weights before the step's first optimizer
step (verl's, slime's and AReaL's recompute: the proximal policy of decoupled PPO when groups are
stale), and ``grpo.rollout_correction`` weighs each token's policy-gradient term by
``exp(old_trainer - engine)``, truncated at C (or masked outside it), in the fused loss
(``osvl.step.rollout_correction``). The ``|old_trainer - engine|`` histogram is logged either way.
"""

from __future__ import annotations

import torch

DELTA_EDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # |old_trainer - engine| histogram bins (nats), open above
DELTA_NAMES = ("lt_1e-4", "1e-4_1e-3", "1e-3_1e-2", "1e-2_1e-1", "1e-1_1", "ge_1")


def mismatch_sums(old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Device-side sums of ``|old - behaviour|`` over the ``mask`` tokens: their count, the total, and the
    count in each ``DELTA_EDGES`` bin (summed over ranks and micro-batches, then ``mismatch_metrics``)."""
    weight = mask.double()
    delta = (old.double() - behaviour.double()).abs() * weight
    bins = torch.bucketize(delta, torch.tensor(DELTA_EDGES, dtype=torch.float64, device=delta.device), right=True)
    counts = torch.zeros(len(DELTA_NAMES), dtype=torch.float64, device=delta.device).index_add_(0, bins, weight)
    sums = {"mismatch_tokens": weight.sum(), "mismatch_abs": delta.sum()}
    sums.update({f"mismatch_{name}": counts[i] for i, name in enumerate(DELTA_NAMES)})
    return sums


def mismatch_metrics(summed: dict[str, float]) -> dict[str, float]:
    """Mean ``|old_trainer - engine|`` and the share of tokens in each bin (``logprob_delta/<bin>``)."""
    n = summed.get("mismatch_tokens", 0.0)
    if not n:
        return {}
    out = {"mismatch_abs_diff": summed["mismatch_abs"] / n}
    out.update({f"logprob_delta/{name}": summed[f"mismatch_{name}"] / n for name in DELTA_NAMES})
    return out
