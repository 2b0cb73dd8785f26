"""grpo_loss refuses malformed inputs with a clear ValueError before computing anything."""

from __future__ import annotations

import pytest
import torch

from osvl_kernels import grpo_loss
from tests.kernels.packed import random_packed_batch

KEYS = ("target_ids", "cu_seqlens", "loss_mask", "old_logprobs", "rewards", "group_ids", "fatal_step", "token_step")


def base_inputs() -> dict:
    batch = random_packed_batch(seed=1)
    inputs = {k: batch[k] for k in KEYS}
    inputs["logits"] = batch["logits"].clone().requires_grad_()
    return inputs


def mutate(name: str):
    inputs = base_inputs()
    T, V = inputs["logits"].shape
    S = inputs["cu_seqlens"].numel() - 1
    if name == "logits_3d":
        inputs["logits"] = inputs["logits"].detach()[None]
    elif name == "logits_int":
        inputs["logits"] = torch.zeros(T, V, dtype=torch.int32)
    elif name == "targets_short":
        inputs["target_ids"] = inputs["target_ids"][:-1]
    elif name == "targets_float":
        inputs["target_ids"] = inputs["target_ids"].float()
    elif name == "target_out_of_range":
        t = inputs["target_ids"].clone()
        t[inputs["loss_mask"].nonzero()[0]] = V
        inputs["target_ids"] = t
    elif name == "cu_not_covering":
        cu = inputs["cu_seqlens"].clone()
        cu[-1] = T - 1
        inputs["cu_seqlens"] = cu
    elif name == "cu_not_from_zero":
        cu = inputs["cu_seqlens"].clone()
        cu[0] = 1
        inputs["cu_seqlens"] = cu
    elif name == "cu_decreasing":
        cu = inputs["cu_seqlens"].clone()
        cu[1] = cu[2] + 1  # sequence 1 now ends before it starts
        inputs["cu_seqlens"] = cu
    elif name == "cu_float":
        inputs["cu_seqlens"] = inputs["cu_seqlens"].float()
    elif name == "mask_not_bool":
        inputs["loss_mask"] = inputs["loss_mask"].float()
    elif name == "fatal_without_token_step":
        inputs["token_step"] = None
    elif name == "fatal_bad_value":
        f = inputs["fatal_step"].clone()
        f[0] = -2
        inputs["fatal_step"] = f
    elif name == "rewards_wrong_len":
        inputs["rewards"] = torch.rand(S + 1)
    elif name == "rewards_nan":
        r = inputs["rewards"].clone()
        r[0] = float("nan")
        inputs["rewards"] = r
    elif name == "no_rewards_no_advantages":
        inputs["rewards"] = None
    elif name == "both_rewards_and_advantages":
        inputs["advantages"] = torch.rand(S)
    elif name == "advantages_wrong_len":
        inputs.update(rewards=None, group_ids=None, advantages=torch.rand(S + 2))
    elif name == "old_logprobs_wrong_len":
        inputs["old_logprobs"] = torch.rand(T + 1)
    return inputs


CASES = {
    "logits_3d": "2-D",
    "logits_int": "fp32/bf16/fp16",
    "targets_short": "target_ids must have shape",
    "targets_float": "target_ids must be a int",
    "target_out_of_range": "target_ids of loss tokens",
    "cu_not_covering": "cover every token",
    "cu_not_from_zero": "start at 0",
    "cu_decreasing": "non-decreasing",
    "cu_float": "integer",
    "mask_not_bool": "loss_mask must be a bool",
    "fatal_without_token_step": "needs token_step",
    "fatal_bad_value": "fatal_step must be -1",
    "rewards_wrong_len": "rewards must have shape",
    "rewards_nan": "finite",
    "no_rewards_no_advantages": "rewards and group_ids",
    "both_rewards_and_advantages": "either advantages",
    "advantages_wrong_len": "advantages must have shape",
    "old_logprobs_wrong_len": "old_logprobs must have shape",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_input_raises_before_any_work(case):
    inputs = mutate(case)
    logits = inputs.pop("logits")
    with pytest.raises(ValueError, match=CASES[case]):
        grpo_loss(logits, **inputs, backend="torch")
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.requires_grad:
        assert logits.grad is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(loss_agg="sum"), "unknown loss_agg"),
        (dict(loss_agg="seq-mean-token-sum-norm"), "max_response_len"),
        (dict(estimator="ppo"), "unknown estimator"),
        (dict(temperature=0.0), "temperature"),
        (dict(eps_low=1.5), "eps_low"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(kl_coef=0.1), "ref_logprobs"),
        (dict(backend="cuda"), "unknown backend"),
        (dict(num_tokens=0), "num_tokens"),
    ],
)
def test_bad_options_raise(kwargs, message):
    inputs = base_inputs()
    logits = inputs.pop("logits")
    with pytest.raises(ValueError, match=message):
        grpo_loss(logits, **inputs, **{"backend": "torch", **kwargs})


def test_failed_inplace_call_leaves_logits_intact():
    inputs = mutate("cu_not_covering")
    logits = inputs.pop("logits")
    before = logits.detach().clone()
    with pytest.raises(ValueError):
        grpo_loss(logits, **inputs, backend="torch", inplace_grad=True)
    assert torch.equal(logits.detach(), before)
