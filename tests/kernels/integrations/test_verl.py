"""The verl adapter through verl 0.9.1's own registries, config and layout helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

import osvl_kernels.integrations.verl_plugin  # noqa: F401  (registers, as VERL_USE_EXTERNAL_MODULES does)
from osvl_kernels import group_advantages
from osvl_kernels.integrations.verl import (
    ADV_ESTIMATOR_NAME,
    POLICY_LOSS_NAME,
    fatal_aware_trainer,
    fatal_flags,
    fatal_flags_from_extra_fields,
    fatal_grpo_advantage,
    osvl_policy_loss,
    responses_to_packed,
    verl_fused_policy_loss,
    verl_fused_ppo_loss,
)


def actor_config(**kw) -> ActorConfig:
    base = dict(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    return ActorConfig(**{**base, **kw})


def response_batch(seed: int, B: int = 4, R: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([6, 2, 4, 5])[:B]
    mask = torch.arange(R)[None] < lens[:, None]
    mask[2, 1] = False  # a tool observation inside the response
    return dict(
        old_log_prob=-torch.rand(B, R, generator=g) * 3 - 0.5,
        log_prob=-torch.rand(B, R, generator=g) * 3 - 0.5,
        advantages=torch.randn(B, 1, generator=g).expand(B, R) * mask,
        response_mask=mask,
    )


def test_registered_in_verl_registries():
    assert core_algos.get_policy_loss_fn(POLICY_LOSS_NAME) is osvl_policy_loss
    assert core_algos.get_adv_estimator_fn(ADV_ESTIMATOR_NAME) is fatal_grpo_advantage


VERL_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]


@pytest.mark.parametrize("mode", VERL_MODES)
def test_policy_loss_matches_verl_vanilla(mode):
    """Where osvl and verl agree (no empty rows, |log-ratio| < 20) the losses and gradients match."""
    batch = response_batch(0)
    config = actor_config(loss_agg_mode=mode)
    results = []
    for name in (POLICY_LOSS_NAME, "vanilla"):
        log_prob = batch["log_prob"].clone().requires_grad_()
        loss, metrics = core_algos.get_policy_loss_fn(name)(
            old_log_prob=batch["old_log_prob"],
            log_prob=log_prob,
            advantages=batch["advantages"],
            response_mask=batch["response_mask"],
            loss_agg_mode=mode,
            config=config,
            rollout_is_weights=None,
        )
        loss.backward()
        results.append((loss.detach(), log_prob.grad, metrics))
    (ours, g_ours, m_ours), (theirs, g_theirs, m_theirs) = results
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(g_ours, g_theirs)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        torch.testing.assert_close(torch.as_tensor(m_ours[key]).float(), torch.tensor(float(m_theirs[key])))


@pytest.mark.parametrize("mode", VERL_MODES)
def test_policy_loss_uses_verl_global_batch_info(mode):
    batch = response_batch(1)
    config = actor_config(loss_agg_mode=mode)
    config.global_batch_info.update(dp_size=2, batch_num_tokens=40, global_batch_size=8, loss_scale_factor=None)
    weights = torch.rand(4, 6)
    loss, _ = osvl_policy_loss(**batch, loss_agg_mode=mode, config=config, rollout_is_weights=weights)
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        **batch, loss_agg_mode=mode, config=config, rollout_is_weights=weights
    )
    torch.testing.assert_close(loss, theirs)


def test_policy_loss_needs_global_batch_info_under_dp():
    batch = response_batch(1)
    config = actor_config(loss_agg_mode="token-mean")
    config.global_batch_info.update(dp_size=2, batch_num_tokens=None, global_batch_size=8, loss_scale_factor=None)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        osvl_policy_loss(**batch, loss_agg_mode="token-mean", config=config)


def test_policy_loss_bad_shapes_raise_value_error():
    batch = response_batch(2)
    with pytest.raises(ValueError, match="advantages shape"):
        osvl_policy_loss(**{**batch, "advantages": batch["advantages"][:, :3]}, config=actor_config())
    with pytest.raises(ValueError, match="unknown loss_agg"):
        osvl_policy_loss(**batch, loss_agg_mode="token-max", config=actor_config())


def test_advantage_estimator_with_verl_kwargs_and_fatal_clamp():
    B, R = 6, 5
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    token_rewards = torch.zeros(B, R)
    token_rewards[:, -1] = rewards
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[1, 3:] = False  # fatal at its 4th token
    uids = np.array(["p0", "p0", "p0", "p1", "p1", "p1"], dtype=object)
    is_fatal = torch.tensor([False, True, False, False, False, True])
    estimator = core_algos.get_adv_estimator_fn(ADV_ESTIMATOR_NAME)
    adv, returns = estimator(
        token_level_rewards=token_rewards, response_mask=mask, config=None, index=uids, is_fatal=is_fatal
    )
    expected = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), is_fatal)
    torch.testing.assert_close(adv, expected[:, None] * mask)
    assert torch.equal(adv, returns)
    assert adv[1].min() >= 0 and adv[5].min() >= 0  # fatal and below the mean: clamped to 0
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, uids)
    no_clamp, _ = estimator(
        token_level_rewards=token_rewards,
        response_mask=mask,
        config=None,
        index=uids,
        is_fatal=torch.zeros(B, dtype=torch.bool),
    )
    torch.testing.assert_close(no_clamp, verl_adv)
    with pytest.raises(ValueError, match="index"):
        estimator(token_level_rewards=token_rewards, response_mask=mask, config=None, is_fatal=is_fatal)
    # verl's compute_advantage passes no flags: silently clamping nothing was the bug.
    with pytest.raises(ValueError, match="trainer_mode=osvl_fatal_"):
        estimator(token_level_rewards=token_rewards, response_mask=mask, config=None, index=uids)
    with pytest.raises(ValueError, match=r"is_fatal must be \[B=6\]"):
        estimator(token_level_rewards=token_rewards, response_mask=mask, config=None, index=uids, is_fatal=is_fatal[:4])


def verl_rmpad_batch(seed: int, H: int = 8, V: int = 23) -> dict:
    """verl's no-padding layout: sequences (prompt + response) back to back, labels rolled by one."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = torch.tensor([3, 2, 4]), torch.tensor([4, 1, 3])
    seq_lens = prompt_lens + response_lens
    cu = torch.zeros(4, dtype=torch.long)
    cu[1:] = seq_lens.cumsum(0)
    T = int(cu[-1])
    input_ids = torch.randint(0, V, (T,), generator=g)
    R = int(response_lens.max())
    mask = torch.arange(R)[None] < response_lens[:, None]
    return dict(
        hidden=torch.randn(T, H, generator=g),
        weight=torch.randn(V, H, generator=g) * 0.5,
        input_ids=input_ids,
        rolled=torch.roll(input_ids, -1),
        cu=cu,
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        response_mask=mask,
        old=-torch.rand(3, R, generator=g) * 3 - 0.5,
        ref=-torch.rand(3, R, generator=g) * 3 - 0.5,
        advantages=torch.randn(3, 1, generator=g).expand(3, R) * mask,
    )


def verl_padded(values: torch.Tensor, b: dict) -> torch.Tensor:
    """verl's own no_padding_2_padding: packed model outputs -> padded response fields."""

    def nested(lens):
        return torch.nested.nested_tensor_from_jagged(torch.zeros(int(lens.sum())), lengths=lens)

    data = TensorDict({"prompts": nested(b["prompt_lens"]), "responses": nested(b["response_lens"])}, batch_size=[3])
    return no_padding_2_padding(values, data)


def test_responses_to_packed_inverts_verl_no_padding_2_padding():
    b = verl_rmpad_batch(0)
    x = torch.randn(3, 4) * b["response_mask"]
    torch.testing.assert_close(verl_padded(responses_to_packed(x, b["cu"], b["response_lens"]), b), x)


@pytest.mark.parametrize("use_kl", [False, True])
def test_fused_hook_equals_log_prob_path(use_kl):
    """Fused loss from hidden states == verl's ppo_loss composition: log-probs from full logits,
    sliced by no_padding_2_padding, osvl policy loss + entropy and k3 KL terms aggregated alike."""
    b = verl_rmpad_batch(1)
    with torch.no_grad():  # a reference policy near the current one: verl clamps k3 at 10
        true = torch.log_softmax((b["hidden"] @ b["weight"].T) / 0.8, -1).gather(1, b["rolled"][:, None])[:, 0]
        b["ref"] = verl_padded(true, b) + 0.3 * torch.randn(b["ref"].shape, generator=torch.Generator().manual_seed(5))
    config = actor_config(
        loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=use_kl, kl_loss_coef=0.1, kl_loss_type="k3"
    )
    h, w = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    loss, metrics = verl_fused_policy_loss(
        h,
        w,
        b["rolled"],
        b["cu"],
        b["response_lens"],
        b["old"],
        b["advantages"],
        b["response_mask"],
        config=config,
        temperature=0.8,
        ref_log_prob=b["ref"],
    )
    loss.backward()

    h2, w2 = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    logp_all = torch.log_softmax((h2 @ w2.T) / 0.8, dim=-1)
    log_prob = verl_padded(logp_all.gather(1, b["rolled"][:, None])[:, 0], b)
    entropy = verl_padded(-(logp_all.exp() * logp_all).sum(-1), b)
    ref_loss, _ = osvl_policy_loss(
        b["old"], log_prob, b["advantages"], b["response_mask"], "seq-mean-token-mean", config
    )
    ref_loss = ref_loss - 0.01 * core_algos.agg_loss(entropy, b["response_mask"], "seq-mean-token-mean")
    if use_kl:
        kl = core_algos.kl_penalty(log_prob, b["ref"], "k3")
        ref_loss = ref_loss + 0.1 * core_algos.agg_loss(kl, b["response_mask"], "seq-mean-token-mean")
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-6)
    assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


def test_fused_hook_bad_inputs_raise_value_error():
    b = verl_rmpad_batch(2)
    args = (
        b["hidden"],
        b["weight"],
        b["rolled"],
        b["cu"],
        b["response_lens"],
        b["old"],
        b["advantages"],
        b["response_mask"],
    )
    with pytest.raises(ValueError, match="ref_log_prob"):
        verl_fused_policy_loss(*args, config=actor_config(use_kl_loss=True, kl_loss_type="k3"))
    with pytest.raises(ValueError, match="kl_loss_type"):
        verl_fused_policy_loss(*args, config=actor_config(use_kl_loss=True, kl_loss_type="mse"), ref_log_prob=b["ref"])
    with pytest.raises(ValueError, match=r"\[1, T, H\]"):
        verl_fused_policy_loss(b["hidden"][None].expand(2, -1, -1), *args[1:], config=actor_config())
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        responses_to_packed(b["old"], b["cu"][:-1], b["response_lens"])


def verl_micro_batch(
    b: dict, *, temperature: float, dp_size: int, batch_num_tokens, global_batch_size, rollout_is_weights=None
) -> TensorDict:
    """The micro-batch TensorDict verl's engine hands `ppo_loss` (no-padding mode): nested
    input_ids / prompts / responses, nested response fields, global counts as non-tensor data."""

    def nested(values, lens):  # as verl builds them (response_to_nested)
        return torch.nested.as_nested_tensor(list(values.split(lens.tolist())), layout=torch.jagged)

    mask = b["response_mask"]
    starts = b["cu"][:-1]
    prompts = torch.cat([b["input_ids"][s : s + p] for s, p in zip(starts.tolist(), b["prompt_lens"].tolist())])
    responses = torch.cat(
        [
            b["input_ids"][s + p : s + p + r]
            for s, p, r in zip(starts.tolist(), b["prompt_lens"].tolist(), b["response_lens"].tolist())
        ]
    )
    fields = {
        "input_ids": nested(b["input_ids"], b["prompt_lens"] + b["response_lens"]),
        "prompts": nested(prompts, b["prompt_lens"]),
        "responses": nested(responses, b["response_lens"]),
        "response_mask": nested(mask[mask].long(), b["response_lens"]),
        "old_log_probs": nested(b["old"][mask], b["response_lens"]),
        "advantages": nested(b["advantages"][mask], b["response_lens"]),
        "ref_log_prob": nested(b["ref"][mask], b["response_lens"]),
    }
    if rollout_is_weights is not None:
        fields["rollout_is_weights"] = nested(rollout_is_weights[mask], b["response_lens"])
    data = TensorDict(fields, batch_size=[3])
    tu.assign_non_tensor(
        data,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        temperature=temperature,
    )
    return data


@pytest.mark.parametrize("loss_mode", [POLICY_LOSS_NAME, "vanilla"])
@pytest.mark.parametrize("mode", VERL_MODES)
def test_fused_ppo_loss_equals_verl_ppo_loss(loss_mode, mode):
    """verl's own ppo_loss (log-probs from full logits) vs the fused loss on the same micro-batch:
    a reference policy far from the current one (verl clamps the KL estimate at 10), entropy,
    rollout IS weights, data parallel global counts and every aggregation."""
    b = verl_rmpad_batch(3)
    with torch.no_grad():
        true = torch.log_softmax((b["hidden"] @ b["weight"].T) / 0.8, -1).gather(1, b["rolled"][:, None])[:, 0]
        g = torch.Generator().manual_seed(9)
        b["ref"] = verl_padded(true, b) + 4.0 * torch.randn(b["ref"].shape, generator=g)
        delta = b["ref"] - verl_padded(true, b)
        k3 = delta.exp() - delta - 1
        assert (k3[b["response_mask"]] > 10).any() and (k3[b["response_mask"]] < 10).any()
    weights = torch.rand(3, 4, generator=g) * 2
    data = verl_micro_batch(
        b, temperature=0.8, dp_size=2, batch_num_tokens=13, global_batch_size=5, rollout_is_weights=weights
    )

    def config():
        return actor_config(
            loss_agg_mode=mode,
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            kl_loss_type="low_var_kl",
            policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        )

    h, w = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    loss, metrics = verl_fused_ppo_loss(config(), h, w, data)
    loss.backward()

    h2, w2 = b["hidden"].clone().requires_grad_(), b["weight"].clone().requires_grad_()
    logp_all = torch.log_softmax((h2 @ w2.T) / 0.8, dim=-1)
    seq_lens = b["prompt_lens"] + b["response_lens"]
    model_output = {
        "log_probs": torch.nested.nested_tensor_from_jagged(
            logp_all.gather(1, b["rolled"][:, None])[:, 0], lengths=seq_lens
        ),
        "entropy": torch.nested.nested_tensor_from_jagged(-(logp_all.exp() * logp_all).sum(-1), lengths=seq_lens),
    }
    expected, _ = ppo_loss(config(), model_output, data)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-6)
    assert set(metrics) >= {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/kl_loss"}


def test_fused_ppo_loss_refuses_mixed_temperatures_and_padded_batches():
    b = verl_rmpad_batch(4)
    data = verl_micro_batch(b, temperature=0.8, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    tu.assign_non_tensor(data, temperature=torch.tensor([0.8, 0.8, 1.0]))
    with pytest.raises(ValueError, match="one temperature"):
        verl_fused_ppo_loss(actor_config(), b["hidden"], b["weight"], data)
    padded = TensorDict({"input_ids": torch.zeros(3, 5, dtype=torch.long)}, batch_size=[3])
    with pytest.raises(ValueError, match="nested input_ids"):
        verl_fused_ppo_loss(actor_config(), b["hidden"], b["weight"], padded)


def test_fatal_flags_from_reward_extra_info():
    extra = [
        {"reward_extra_info": {"osvl_fatal": True, "acc": 0.0}},
        {"reward_extra_info": {"acc": 1.0}},
        {},
        None,
        {"reward_extra_info": {"osvl_fatal": np.bool_(False)}},
        {"reward_extra_info": {"osvl_fatal": 1}},
    ]
    assert fatal_flags_from_extra_fields(extra).tolist() == [True, False, False, False, False, True]
    with pytest.raises(ValueError, match=r"sample 0: reward_extra_info\['osvl_fatal'\] must be a bool"):
        fatal_flags_from_extra_fields([{"reward_extra_info": {"osvl_fatal": "yes"}}])


class _VerlAdvantageStep:
    """Stands in for verl's v1 PPOTrainer: its `_compute_advantage` calls the registered estimator
    with the keyword arguments verl's compute_advantage passes (no per-sample data)."""

    def __init__(self, rewards: torch.Tensor, uids):
        self.rewards, self.uids = rewards, uids

    def _compute_advantage(self, batch, metrics):
        token_rewards = torch.zeros(len(self.uids), 3)
        token_rewards[:, -1] = self.rewards
        estimator = core_algos.get_adv_estimator_fn(ADV_ESTIMATOR_NAME)
        adv, _ = estimator(
            token_level_rewards=token_rewards, response_mask=torch.ones(len(self.uids), 3), config=None, index=self.uids
        )
        return adv


def test_fatal_aware_trainer_feeds_the_estimator_the_reward_functions_flags():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2])
    uids = np.array(["p", "p", "p", "p"], dtype=object)
    extra = [{"reward_extra_info": {"osvl_fatal": f}} for f in (False, True, False, False)]
    requests = []

    def kv_batch_get(keys, partition_id, select_fields):
        requests.append((keys, partition_id, select_fields))
        return {"extra_fields": extra}

    batch = type("KVBatchMeta", (), {"keys": ["p_0_0", "p_1_0", "p_2_0", "p_3_0"], "partition_id": "train"})()
    metrics = {}
    trainer = fatal_aware_trainer(_VerlAdvantageStep, kv_batch_get=kv_batch_get)(rewards, uids)
    adv = trainer._compute_advantage(batch, metrics)
    expected = group_advantages(rewards, torch.zeros(4, dtype=torch.long), torch.tensor([False, True, False, False]))
    torch.testing.assert_close(adv[:, 0], expected)
    assert adv[1, 0] == 0.0  # fatal, below the group mean: clamped
    assert requests == [(batch.keys, "train", ["extra_fields"])]
    assert metrics["osvl/fatal_frac"] == 0.25
    with pytest.raises(ValueError, match="no fatal flags"):  # the flags do not outlive the step
        _VerlAdvantageStep(rewards, uids)._compute_advantage(batch, {})
    with fatal_flags(torch.zeros(4, dtype=torch.bool)):
        plain = _VerlAdvantageStep(rewards, uids)._compute_advantage(batch, {})
    assert plain[1, 0] < 0
