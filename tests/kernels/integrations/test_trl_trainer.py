"""osvl's loss inside a real TRL 1.16 GRPOTrainer (tiny Qwen2 on CPU), against TRL's own
`_compute_loss` on the same generated batch: the loss, every parameter's gradient and the metrics TRL logs.

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
    # fp32 unless a test asks for GRPOConfig's default bf16 autocast: then both heads round to bf16 their own way
    config.setdefault("bf16", False)
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


# What TRL's _compute_loss logs for the loss types osvl implements, and osvl's compute_loss too.
LOGGED = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


def logged(trainer, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """The loss, the gradients and the last value of each metric `compute` logged."""
    trainer._metrics["train"].clear()
    loss, grads = loss_and_grads(trainer, compute)
    return loss, grads, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def compare_with_trl(trainer, inputs, rtol=1e-4, atol=1e-6, model=None):
    """TRL's `_compute_loss` vs `compute_loss` through the installed osvl loss (called with `model`, a wrapper of
    the trainer's model, when given)."""
    assert isinstance(trainer.osvl_loss, OsvlFusedLinearGRPOLoss)
    expected, expected_grads, expected_metrics = logged(trainer, lambda: trainer._compute_loss(trainer.model, inputs))
    got, grads, metrics = logged(trainer, lambda: trainer.compute_loss(model or trainer.model, inputs))
    torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=atol)
    assert grads.keys() == expected_grads.keys() and len(grads) >= 10
    for name, grad in grads.items():
        torch.testing.assert_close(grad.float(), expected_grads[name].float(), rtol=rtol, atol=atol, msg=name)
    assert any(g.abs().max() > 0 for g in grads.values())
    names = LOGGED + (["kl"] if trainer.beta != 0.0 else [])
    assert set(names) <= set(metrics) and set(names) <= set(expected_metrics), (metrics, expected_metrics)
    for name in names:
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=max(rtol, 1e-4), abs=1e-5), name
    return got


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_trl_defaults_install_and_match(policy_dir, tmp_path, loss_type):
    """GRPOConfig's defaults (use_bias_correction_kl=True, beta=0) install; every loss type matches."""
    trainer = make_trainer(policy_dir, tmp_path, loss_type=loss_type)
    assert trainer.args.use_bias_correction_kl is True and trainer.beta == 0.0
    compare_with_trl(trainer, generated_batch(trainer))


def test_grpo_configs_default_bf16_autocast(policy_dir, tmp_path):
    """GRPOConfig(bf16=True), TRL's default: the backbone under autocast and the head in bf16, as TRL's head."""
    trainer = make_trainer(policy_dir, tmp_path, loss_type="dapo", bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16"
    compare_with_trl(trainer, generated_batch(trainer, seed=7), rtol=2e-2, atol=1e-3)


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
    """The importance-sampling ratio TRL 1.16 hands the loss for a vLLM rollout
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


def test_gradient_accumulation_normalisers(policy_dir, tmp_path):
    """The loss a micro-batch contributes inside an accumulation window of 2 (dapo: of a generation batch split over
    2 steps), as TRL scales it."""
    trainer = make_trainer(policy_dir, tmp_path, loss_type="dapo", steps_per_generation=2)
    trainer.current_gradient_accumulation_steps = 2
    compare_with_trl(trainer, generated_batch(trainer, seed=5))
    trainer.osvl_loss.loss_type = trainer.loss_type = "grpo"
    compare_with_trl(trainer, generated_batch(trainer, seed=5))


def test_the_loss_runs_inside_the_wrappers_forward(policy_dir, tmp_path):
    """Called with a wrapped model (DDP, FSDP, DeepSpeed wrap it for training), the fused loss runs as the wrapped
    model's forward, so the wrapper's hooks fire around it; TRL's own forward is back afterwards."""
    trainer = make_trainer(policy_dir, tmp_path, loss_type="bnpo")
    inputs = generated_batch(trainer, seed=6)
    wrapper = torch.nn.DataParallel(trainer.model)  # on CPU it just calls the module, as a wrapper does
    calls = []
    wrapper.register_forward_pre_hook(lambda module, args: calls.append(module))
    trls_forward = trainer.model.forward
    compare_with_trl(trainer, inputs, model=wrapper)
    assert calls == [wrapper]
    assert trainer.model.forward == trls_forward


def test_refused_configurations_name_the_field(policy_dir, tmp_path):
    for config, field in [
        (dict(loss_type="cispo"), "loss_type='cispo'"),
        (dict(loss_type="sapo"), "loss_type='sapo'"),
        (dict(importance_sampling_level="sequence", loss_type="grpo"), "importance_sampling_level='sequence'"),
        (dict(delta=1.1), r"delta=1.1 must be > 1 \+ epsilon_high"),
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
        (dict(off_policy_mask_threshold=0.1), "off_policy_mask_threshold"),
        (dict(entropy_coef=0.01), "entropy_coef"),
    ]:
        with pytest.raises(ValueError, match=field):
            make_trainer(policy_dir, tmp_path, **config)


def test_example_trains_two_steps(tmp_path):
    from examples.trl_grpo import main

    result = main(["--steps", "1", "--out", str(tmp_path), "--beta", "0.04", "--loss-type", "grpo"])
    trainer = result["trainer"]
    assert isinstance(trainer.osvl_loss, OsvlFusedLinearGRPOLoss)
    assert math.isfinite(result["train_loss"])
    assert trainer.state.global_step == 1
