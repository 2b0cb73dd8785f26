"""The policy step written once: the optimizer step's non-finite guard, the stage's loss settings from the
recipe, the backend choice, the SFT step against float64, and that no other module writes the step again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from osvl.config.recipe import GRPOConfig, OptimizerConfig, SchedulerConfig
from osvl.step import (
    NonFiniteGradient,
    grpo_loss_config,
    loss_backend,
    optim_step,
    packed_forward,
    sft_forward_loss,
    with_backend,
)
from osvl.trainer.optim import build_optimizer, build_scheduler
from osvl_kernels import GRPOLossConfig, RolloutCorrection

ROOT = Path(__file__).resolve().parents[2]


def _trained_linear(loss_scale: float):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    config = OptimizerConfig(lr=0.1, grad_clip=1.0)
    optimizer = build_optimizer(layer.parameters(), config)
    scheduler = build_scheduler(optimizer, 10, SchedulerConfig(kind="cosine", warmup_ratio=0.0))
    (layer(torch.ones(2, 4)).sum() * loss_scale).backward()
    return layer, optimizer, scheduler, config


def test_a_finite_step_clips_updates_and_advances_the_schedule():
    layer, optimizer, scheduler, config = _trained_linear(1.0)
    before = layer.weight.detach().clone()
    expected_norm = torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()
    lr = scheduler.get_last_lr()[0]
    outcome = optim_step(layer.parameters(), optimizer, scheduler, config)
    assert not outcome.skipped and float(outcome.grad_norm) == pytest.approx(float(expected_norm))
    assert not torch.equal(layer.weight, before)
    assert scheduler.get_last_lr()[0] < lr and all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_is_skipped_when_asked(bad):
    layer, optimizer, scheduler, config = _trained_linear(bad)
    config = OptimizerConfig(lr=0.1, grad_clip=1.0, on_nonfinite="skip")
    before = [p.detach().clone() for p in layer.parameters()]
    lr = scheduler.get_last_lr()[0]
    outcome = optim_step(layer.parameters(), optimizer, scheduler, config)
    assert outcome.skipped and not torch.isfinite(outcome.grad_norm)
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))  # no update, no nan in the weights
    assert all(p.grad is None for p in layer.parameters()) and not optimizer.state  # AdamW's moments untouched
    assert scheduler.get_last_lr()[0] < lr  # the schedule's clock is the step count


def test_a_non_finite_gradient_stops_by_default_before_the_update():
    layer, optimizer, scheduler, config = _trained_linear(float("nan"))
    assert config.on_nonfinite == "stop"
    before = layer.weight.detach().clone()
    with pytest.raises(NonFiniteGradient, match=r'gradient norm is nan.*on_nonfinite = "skip"'):
        optim_step(layer.parameters(), optimizer, scheduler, config)
    assert torch.equal(layer.weight, before) and layer.weight.grad is None
    with pytest.raises(ValueError, match="on_nonfinite"):
        OptimizerConfig(on_nonfinite="ignore")


def test_the_stage_loss_settings_come_from_the_recipe_once():
    g = GRPOConfig(
        eps_low=0.1,
        eps_high=0.3,
        kl_coef=0.02,
        entropy_coef=0.001,
        temperature=0.6,
        loss_agg="seq-mean-token-sum-norm",
        max_response_tokens=77,
        old_logprobs="trainer",
        rollout_correction="sequence",
        rollout_correction_mode="mask",
        rollout_correction_cap=1.5,
    )
    config = grpo_loss_config(g)
    assert (config.eps_low, config.eps_high, config.kl_coef, config.entropy_coef) == (0.1, 0.3, 0.02, 0.001)
    assert (config.temperature, config.loss_agg, config.max_response_len) == (0.6, "seq-mean-token-sum-norm", 77)
    assert config.rollout_correction == RolloutCorrection(level="sequence", mode="mask", high=1.5)
    assert config.validate is False and grpo_loss_config(GRPOConfig(check_loss_inputs=True)).validate is True
    assert grpo_loss_config(GRPOConfig()).rollout_correction is None


def test_one_backend_choice_follows_the_device():
    assert loss_backend(torch.device("cpu")) == "torch"
    assert loss_backend(torch.device("cuda", 0)) == "auto"
    config = GRPOLossConfig()
    assert with_backend(config, torch.device("cpu")).backend == "torch"
    same = GRPOLossConfig(backend="torch")
    assert with_backend(same, torch.device("cpu")) is same


def test_the_sft_step_equals_float64():
    from tests.rollout.helpers import tiny_model
    from tests.trainer.test_correction import _batch

    model = tiny_model(3).eval()
    batch = _batch(model)
    loss = sft_forward_loss(model, batch, normalizer=7, chunk=5)
    on_device, hidden = packed_forward(model, batch)
    assert hidden.shape[0] == on_device.num_tokens
    weight = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    logits = hidden.double() @ weight.double().t()
    nll = torch.logsumexp(logits, -1) - logits.gather(1, on_device.target_ids[:, None]).squeeze(1)
    assert float(loss) == pytest.approx(float(nll[on_device.loss_mask].sum() / 7), rel=1e-5)


def _calls(path: Path) -> list[str]:
    """What the file calls that is the policy step: the packed forward to hidden states, the fused loss,
    the gradient clip, and an optimizer's step."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if any(k.arg == "return_hidden" for k in node.keywords):
            found.append("forward to hidden states")
        if name in ("linear_grpo_loss", "clip_grad_norm_", "sft_loss"):
            found.append(name)
        if name == "step" and isinstance(node.func, ast.Attribute) and "optim" in ast.unparse(node.func.value):
            found.append("optimizer.step")
    return found


def test_nothing_else_writes_the_step():
    """The stages, the pre-flight probe and the step benchmark call osvl.step; no other module of osvl (bar the
    mechanism study, which scores a synthetic objective, not the policy) nor bench/train_step.py writes any
    part of the step again."""
    files = [*sorted((ROOT / "osvl").rglob("*.py")), ROOT / "bench" / "train_step.py"]
    allowed = {ROOT / "osvl" / "step" / "policy_step.py", ROOT / "osvl" / "study" / "mechanism.py"}
    copies = {str(p.relative_to(ROOT)): _calls(p) for p in files if p not in allowed and _calls(p)}
    assert not copies, copies
    assert set(_calls(ROOT / "osvl" / "step" / "policy_step.py")) == {
        "forward to hidden states",
        "linear_grpo_loss",
        "clip_grad_norm_",
        "sft_loss",
        "optimizer.step",
    }
