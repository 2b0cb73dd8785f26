"""osvl's loss inside a real TRL 1.13 GRPOTrainer (tiny Qwen2 on CPU), against TRL's own
`_compute_loss` on the same generated batch: the loss and every parameter's gradient.

Each case is a configuration TRL users run: its defaults (dapo, use_bias_correction_kl=True), a
reference model with the bias-corrected KL, a bf16 policy with an fp32 lm_head, the vLLM
importance-sampling ratio in its modes, and delta."""

from __future__ import annotations

import math

import pytest
import torch

from examples.trl_grpo import build_trainer, tiny_policy, tiny_tokenizer
from osvl_kernels.integrations.trl import OsvlFusedLinearGRPOLoss

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")


def make_trainer(policy_dir, tmp_path, **config):
    trainer = build_trainer(policy_dir, str(tmp_path), tiny_tokenizer(), **config)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which these tests skip
    return trainer


def generated_batch(trainer, seed: int = 0, drift: float = 0.3) -> dict:
    """TRL's own rollout step on 4 prompts; old log-probs as if the policy had moved since."""
    torch.manual_seed(seed)
    rows = [trainer.train_dataset[i] for i in range(4)]
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(rows)
    assert inputs["advantages"].abs().sum() > 0, "all rewards tied: nothing to compare"
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].shape[1],
        )
    g = torch.Generator().manual_seed(seed + 1)
    inputs["old_per_token_logps"] = logps.float() + drift * torch.randn(logps.shape, generator=g)
    return inputs


def loss_and_grads(trainer, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return loss.detach(), grads


def compare_with_trl(trainer, inputs, rtol=1e-4, atol=1e-6):
    """TRL's `_compute_loss` vs `compute_loss` through the installed osvl loss."""
    assert isinstance(trainer.liger_loss, OsvlFusedLinearGRPOLoss)
    expected, expected_grads = loss_and_grads(trainer, lambda: trainer._compute_loss(trainer.model, inputs))
    got, grads = loss_and_grads(trainer, lambda: trainer.compute_loss(trainer.model, inputs))
    torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=atol)
    assert grads.keys() == expected_grads.keys() and len(grads) >= 10
    for name, grad in grads.items():
        torch.testing.assert_close(grad.float(), expected_grads[name].float(), rtol=rtol, atol=atol, msg=name)
    assert any(g.abs().max() > 0 for g in grads.values())
    return got


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_trl_defaults_install_and_match(policy_dir, tmp_path, loss_type):
    """GRPOConfig's defaults (use_bias_correction_kl=True, beta=0) install; every loss type matches."""
    trainer = make_trainer(policy_dir, tmp_path, loss_type=loss_type)
    assert trainer.args.use_bias_correction_kl is True and trainer.beta == 0.0
    compare_with_trl(trainer, generated_batch(trainer))


@pytest.mark.parametrize("bias_correction", [True, False])
def test_reference_model_kl_with_and_without_bias_correction(policy_dir, tmp_path, bias_correction):
    trainer = make_trainer(policy_dir, tmp_path, loss_type="grpo", beta=0.1, use_bias_correction_kl=bias_correction)
    inputs = generated_batch(trainer, seed=1)
    inputs["ref_per_token_logps"] = inputs["ref_per_token_logps"] - 0.5  # a reference the policy has left
    compare_with_trl(trainer, inputs)


def test_bf16_policy_with_fp32_lm_head(policy_dir, tmp_path):
    trainer = make_trainer(
        policy_dir, tmp_path, loss_type="bnpo", model_init_kwargs={"dtype": torch.bfloat16}, cast_lm_head_to_fp32=True
    )
    assert trainer.model.lm_head.weight.dtype == torch.float32
    assert trainer.model.model.embed_tokens.weight.dtype == torch.bfloat16
    compare_with_trl(trainer, generated_batch(trainer, seed=2), rtol=2e-2, atol=1e-3)


def trl_vllm_ratio(old, sampling, mask, mode: str, clip_min, clip_max) -> torch.Tensor:
    """The importance-sampling ratio TRL 1.13 hands the loss for a vLLM rollout
    (`_generate_and_score_completions`, vllm_importance_sampling_correction=True)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize(
    "mode, clip_min, clip_max",
    [
        ("sequence_mask", None, 3.0),
        ("token_truncate", None, 1.5),
        ("token_mask", 0.5, 1.5),
        ("sequence_truncate", 0.2, 2.0),
    ],
)
def test_vllm_importance_sampling_correction(policy_dir, tmp_path, mode, clip_min, clip_max):
    trainer = make_trainer(policy_dir, tmp_path, loss_type="dapo", beta=0.05)
    inputs = generated_batch(trainer, seed=3)
    # What use_vllm=True sets up (vLLM itself is not installed here): TRL's _compute_loss then
    # multiplies the policy-gradient term by inputs["importance_sampling_ratio"].
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    g = torch.Generator().manual_seed(7)
    sampling = inputs["old_per_token_logps"] + 0.4 * torch.randn(inputs["old_per_token_logps"].shape, generator=g)
    ratio = trl_vllm_ratio(inputs["old_per_token_logps"], sampling, inputs["completion_mask"], mode, clip_min, clip_max)
    assert ((ratio > 0) & (ratio != 1)).any()
    inputs["importance_sampling_ratio"] = ratio
    got = compare_with_trl(trainer, inputs)
    del inputs["importance_sampling_ratio"]
    trainer.use_vllm = False
    assert not torch.allclose(got, trainer._compute_loss(trainer.model, inputs).detach())  # the ratio mattered


def test_delta_bounds_negative_advantage_ratios(policy_dir, tmp_path):
    trainer = make_trainer(policy_dir, tmp_path, loss_type="grpo", delta=1.4)
    compare_with_trl(trainer, generated_batch(trainer, seed=4, drift=0.6))


def test_refused_configurations_name_the_field(policy_dir, tmp_path):
    for config, field in [
        (dict(loss_type="cispo"), "loss_type='cispo'"),
        (dict(loss_type="sapo"), "loss_type='sapo'"),
        (dict(importance_sampling_level="sequence", loss_type="grpo"), "importance_sampling_level='sequence'"),
        (dict(delta=1.1), r"delta=1.1 must be > 1 \+ epsilon_high"),
    ]:
        with pytest.raises(ValueError, match=field):
            make_trainer(policy_dir, tmp_path, **config)


def test_example_trains_two_steps(tmp_path):
    from examples.trl_grpo import main

    result = main(["--steps", "1", "--out", str(tmp_path), "--beta", "0.04", "--loss-type", "grpo"])
    trainer = result["trainer"]
    assert isinstance(trainer.liger_loss, OsvlFusedLinearGRPOLoss)
    assert math.isfinite(result["train_loss"])
    assert trainer.state.global_step == 1
