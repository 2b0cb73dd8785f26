"""The verl and torchtitan examples run on CPU and agree with their hosts (the TRL example runs in
test_trl_trainer.py); the verl overrides name keys verl 0.9.1's configuration has."""

from __future__ import annotations

import os

import pytest
import torch
import verl
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from examples import torchtitan_grpo, verl_grpo


def test_verl_example_fused_loss_equals_verls_ppo_loss_and_clamps_the_fatal_sample():
    result = verl_grpo.main([])
    assert [s["osvl_fatal"] for s in result["scores"]] == [False, True, False, False]
    adv = result["advantages"][:, 0]
    assert adv[1] == 0.0 and adv[2] < 0  # the fatal sample (reward 0, below the mean) is clamped, the other not
    torch.testing.assert_close(result["fused_loss"], result["verl_loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["fused_grad"], result["verl_grad"], rtol=1e-4, atol=1e-6)


def test_verl_reward_function_flags_three_failed_tool_calls_in_a_row():
    err = "<tool_response>Error: 404</tool_response>"
    ok = "<tool_response>result</tool_response>"
    assert verl_grpo.compute_score("d", err + err + err, "x")["osvl_fatal"] is True
    assert verl_grpo.compute_score("d", err + err + ok + err, "x")["osvl_fatal"] is False
    assert verl_grpo.compute_score("d", ok + "<answer> x </answer>", "x") == {"score": 1.0, "osvl_fatal": False}


def test_verl_overrides_name_keys_in_verls_config():
    reference = os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml")
    config = OmegaConf.load(reference)
    OmegaConf.set_struct(config, True)  # unknown keys raise, as Hydra's overrides do
    merged = OmegaConf.merge(config, OmegaConf.from_dotlist(verl_grpo.VERL_OVERRIDES))
    assert merged.algorithm.adv_estimator == "osvl_fatal_grpo"
    assert merged.trainer.v1.trainer_mode == "osvl_fatal_sync"
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(config, OmegaConf.from_dotlist(["actor_rollout_ref.actor.clip_ratio_hi=0.3"]))
    assert verl_grpo.main(["--print-overrides"])["overrides"] == verl_grpo.VERL_OVERRIDES


def test_torchtitan_example_chunked_loss_equals_the_whole_batch():
    result = torchtitan_grpo.main(["--chunks", "4"])
    got, expected = result["chunked"], result["whole"]
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["grad_hidden"], expected["grad_hidden"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got["grad_lm_head"], expected["grad_lm_head"], rtol=1e-4, atol=1e-6)
    assert got["grad_lm_head"].abs().max() > 0


def test_the_integrations_page_shows_the_verl_overrides_the_example_checks():
    page = os.path.join(os.path.dirname(os.path.dirname(verl_grpo.__file__)), "docs", "integrations.md")
    text = open(page, encoding="utf-8").read()
    missing = [override for override in verl_grpo.VERL_OVERRIDES if override not in text]
    assert not missing, f"docs/integrations.md's verl command lacks {missing}"
