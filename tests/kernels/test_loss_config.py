"""One loss config for every entry point: the settings are written once (GRPOLossConfig), each entry point
takes them as ``config=`` or as keywords on top of it, a misspelt setting names the near one, and a bad
value is refused when the config is built, before any tensor is read."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from osvl_kernels import GRPOLossConfig, grpo_loss, linear_grpo_loss
from osvl_kernels.loss_config import SETTINGS, LossHyper
from osvl_kernels.reference import reference_grpo_loss

ENTRY_POINTS = (grpo_loss, linear_grpo_loss, reference_grpo_loss)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T, H, V = 10, 6, 11
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (T,), generator=g)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    mask = torch.ones(T, dtype=torch.bool)
    old = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None]).squeeze(1) - 0.1
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    return hidden, weight, targets, cu, mask, old, rewards, torch.tensor([0, 0])


def test_no_entry_point_writes_a_setting_in_its_signature():
    for function in ENTRY_POINTS:
        written = set(inspect.signature(function).parameters) & set(SETTINGS)
        assert not written, f"{function.__name__} repeats {sorted(written)}: they belong to GRPOLossConfig"


@pytest.mark.parametrize("function", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_a_misspelt_setting_names_the_near_one(function):
    hidden, weight, targets, cu, mask, *_ = _batch()
    args = (hidden @ weight.t(), targets) if function is not linear_grpo_loss else (hidden, weight, targets)
    with pytest.raises(TypeError, match=rf"{function.__name__}\(\) .* 'eps_hihg'; did you mean 'eps_high'"):
        function(*args, cu, mask, eps_hihg=0.3)


def test_config_and_keywords_give_the_same_loss_on_every_entry_point():
    hidden, weight, targets, cu, mask, old, rewards, groups = _batch()
    config = GRPOLossConfig(eps_low=0.05, eps_high=0.07, temperature=0.8, loss_agg="token-mean", backend="torch")
    keywords = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    tensors = dict(old_logprobs=old, rewards=rewards, group_ids=groups)
    logits = hidden @ weight.t()
    by_config = [
        grpo_loss(logits, targets, cu, mask, **tensors, config=config).loss,
        linear_grpo_loss(hidden, weight, targets, cu, mask, **tensors, config=config).loss,
        reference_grpo_loss(logits, targets, cu, mask, **tensors, config=config)[0],
    ]
    by_keywords = [
        grpo_loss(logits, targets, cu, mask, **tensors, **keywords).loss,
        linear_grpo_loss(hidden, weight, targets, cu, mask, **tensors, **keywords).loss,
        reference_grpo_loss(logits, targets, cu, mask, **tensors, **keywords)[0],
    ]
    default = reference_grpo_loss(logits, targets, cu, mask, **tensors)[0]
    for a, b in zip(by_config, by_keywords):
        assert float(a) == pytest.approx(float(b), abs=1e-12)
        assert float(a) == pytest.approx(float(by_config[2]), abs=1e-6)  # the fast paths compute in fp32
    assert float(default) != pytest.approx(float(by_config[2]), abs=1e-6)  # the settings did act
    overridden = grpo_loss(logits, targets, cu, mask, **tensors, config=config, eps_high=0.28).loss
    assert float(overridden) == pytest.approx(
        float(reference_grpo_loss(logits, targets, cu, mask, **tensors, config=config, eps_high=0.28)[0]), abs=1e-6
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dict(eps_low=1.5), "eps_low must be in"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(loss_agg="mean"), "unknown loss_agg"),
        (dict(loss_agg="seq-mean-token-sum-norm"), "needs max_response_len"),
        (dict(estimator="ppo"), "unknown estimator"),
        (dict(backend="cuda"), "unknown backend"),
        (dict(rollout_correction="token"), "must be a RolloutCorrection"),
    ],
)
def test_a_bad_setting_is_refused_when_built(bad, message):
    with pytest.raises(ValueError, match=message):
        GRPOLossConfig(**bad)


def test_the_token_pass_sees_only_the_per_token_scalars():
    config = GRPOLossConfig(eps_low=0.1, kl_coef=0.2, kl_max=5.0, loss_agg="token-sum", validate=False)
    hyper = config.hyper
    assert type(hyper) is LossHyper and hyper == LossHyper(eps_low=0.1, kl_coef=0.2, kl_max=5.0)
    with pytest.raises(TypeError, match="config must be a GRPOLossConfig"):
        hidden, weight, targets, cu, mask, *_ = _batch()
        grpo_loss(hidden @ weight.t(), targets, cu, mask, config=hyper)
