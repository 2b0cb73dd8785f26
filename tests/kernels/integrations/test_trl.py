"""The TRL adapter's loss module on TRL's padded batch, compared with Liger's `LigerFusedLinearGRPOLoss` (eager; the
fused loss whose keywords TRL 1.0-1.13's shared) on the same batch. The adapter inside TRL 1.16's
GRPOTrainer: test_trl_trainer.py."""

from __future__ import annotations

import pytest
import torch
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

from osvl_kernels import linear_grpo_loss
from osvl_kernels.integrations import pack, pack_layout
from osvl_kernels.integrations.trl import OsvlFusedLinearGRPOLoss


def padded_batch(seed: int, B: int = 4, L: int = 7, H: int = 16, V: int = 37) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 0, 5])[:B]
    mask = torch.arange(L)[None, :] < lengths[:, None]
    mask[0, 2] = False  # a tool-output token inside a completion (TRL's tool_mask)
    return dict(
        _input=torch.randn(B, L, H, generator=g, dtype=torch.float32),
        lin_weight=torch.randn(V, H, generator=g, dtype=torch.float32) * 0.3,
        selected_token_ids=torch.randint(0, V, (B, L), generator=g),
        attention_mask=mask.long(),
        advantages=torch.randn(B, generator=g, dtype=torch.float32),
        old_per_token_logps=-torch.rand(B, L, generator=g, dtype=torch.float32) * 3 - 1.5,
        ref_per_token_logps=-torch.rand(B, L, generator=g, dtype=torch.float32) * 3 - 1.5,
    )


def run(loss_module, batch: dict, num_items_in_batch=None, vllm_is_ratio=None):
    x = batch["_input"].clone().requires_grad_()
    w = batch["lin_weight"].clone().requires_grad_()
    loss, metrics = loss_module(
        _input=x,
        lin_weight=w,
        selected_token_ids=batch["selected_token_ids"],
        attention_mask=batch["attention_mask"],
        advantages=batch["advantages"],
        bias=None,
        old_per_token_logps=batch["old_per_token_logps"],
        ref_per_token_logps=batch["ref_per_token_logps"],
        vllm_is_ratio=vllm_is_ratio,
        num_items_in_batch=num_items_in_batch,
    )
    loss.backward()
    return loss.detach(), [m.detach() for m in metrics], x.grad, w.grad


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_matches_trl_fused_linear_grpo_loss(loss_type, beta, bias_correction):
    batch = padded_batch(1)
    kw = dict(
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        max_completion_length=9,
        temperature=0.9,
        use_bias_correction_kl=bias_correction,
    )
    liger_loss = LigerFusedLinearGRPOLoss(compiled=False, use_ref_model=beta != 0.0, chunk_size=2, **kw)
    ours = OsvlFusedLinearGRPOLoss(**kw)
    num_items = torch.tensor(13.0) if loss_type == "dapo" else None
    expected = run(liger_loss, batch, num_items)
    got = run(ours, batch, num_items)
    assert_same(got, expected, beta)


@pytest.mark.parametrize("shape", ["token", "sequence"])
def test_vllm_is_ratio_and_delta_match_trl_fused_loss(shape):
    batch = padded_batch(5)
    g = torch.Generator().manual_seed(3)
    ratio = torch.rand(4, 7 if shape == "token" else 1, generator=g) * 2.0
    ratio[1, 0] = 0.0  # masked by vllm_importance_sampling_mode="*_mask"
    kw = dict(beta=0.05, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo", delta=1.5, use_bias_correction_kl=True)
    expected = run(LigerFusedLinearGRPOLoss(compiled=False, chunk_size=2, **kw), batch, torch.tensor(13.0), ratio)
    got = run(OsvlFusedLinearGRPOLoss(**kw), batch, torch.tensor(13.0), ratio)
    assert_same(got, expected, 0.05)
    unweighted = run(OsvlFusedLinearGRPOLoss(**kw), batch, torch.tensor(13.0))
    assert not torch.allclose(got[0], unweighted[0])


def assert_same(got, expected, beta):
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert len(got[1]) == len(expected[1]) == (2 if beta else 1)
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g.double(), e.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[3], expected[3], rtol=1e-4, atol=1e-6)


def test_equals_linear_grpo_loss_on_the_packed_batch():
    batch = padded_batch(2)
    ours = OsvlFusedLinearGRPOLoss(beta=0.0, loss_type="grpo", epsilon_high=0.28)
    loss, _, gx, gw = run(ours, batch)
    layout = pack_layout(batch["attention_mask"])
    h = pack(batch["_input"], layout).requires_grad_()
    w = batch["lin_weight"].clone().requires_grad_()
    targets = pack(batch["selected_token_ids"], layout)
    out = linear_grpo_loss(
        h,
        w,
        targets,
        layout.cu_seqlens,
        torch.ones_like(targets, dtype=torch.bool),
        old_logprobs=pack(batch["old_per_token_logps"], layout),
        advantages=batch["advantages"],
        eps_low=0.2,
        eps_high=0.28,
        loss_agg="seq-mean-token-mean",
    )
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss.detach())
    torch.testing.assert_close(gw, w.grad)
    torch.testing.assert_close(pack(gx, layout), h.grad)
    assert gx[~batch["attention_mask"].bool()].abs().max() == 0


def test_ref_logprobs_from_ref_input_and_weight():
    batch = padded_batch(3)
    ours = OsvlFusedLinearGRPOLoss(beta=0.1, loss_type="bnpo")
    x = batch["_input"].clone().requires_grad_()
    ref_w = batch["lin_weight"] * 1.1
    call = dict(
        _input=x,
        lin_weight=batch["lin_weight"],
        selected_token_ids=batch["selected_token_ids"],
        attention_mask=batch["attention_mask"],
        advantages=batch["advantages"],
    )
    from_input, _ = ours(**call, ref_input=batch["_input"], ref_weight=ref_w)
    ref = torch.log_softmax(batch["_input"] @ ref_w.T, -1).gather(-1, batch["selected_token_ids"][..., None])[..., 0]
    given, _ = ours(**call, ref_per_token_logps=ref)
    torch.testing.assert_close(from_input, given)


def test_unsupported_options_raise_value_error():
    for kw, msg in [
        (dict(loss_type="cispo"), "loss_type='cispo'.*not implemented"),
        (dict(loss_type="vespo"), "loss_type='vespo'.*not implemented"),
        (dict(loss_type="typo"), "unknown"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
        (dict(delta=1.1), r"delta=1.1 must be > 1 \+ epsilon_high"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
    ]:
        with pytest.raises(ValueError, match=msg):
            OsvlFusedLinearGRPOLoss(**kw)
    batch = padded_batch(4)
    loss = OsvlFusedLinearGRPOLoss(loss_type="grpo")
    call = {k: batch[k] for k in ("_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages")}
    with pytest.raises(ValueError, match="bias"):
        loss(**call, bias=torch.zeros(37, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"vllm_is_ratio must be \[B, L\]"):
        loss(**call, vllm_is_ratio=torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"advantages must be \[B=4\]"):
        loss(**{**call, "advantages": torch.zeros(4, 7)})
    with pytest.raises(ValueError, match="last hidden state"):
        loss(**{**call, "_input": batch["_input"][0]})
