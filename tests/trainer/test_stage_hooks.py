"""The stages' hooks, single process: MoE router losses in SFT and GRPO (their metrics, and that the
loss changes the update), and GRPO's in-training validation on held-out prompts."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from osvl.config import load_recipe
from osvl.trainer import read_metrics, run_grpo, run_sft
from osvl.trainer.validation import summary_means, summary_sums, without_faults
from tests.trainer.fixtures import sft_overrides
from tests.trainer.grpo_fixtures import echo_environment, scripted, write_prompts_file
from tests.trainer.test_grpo import grpo_overrides

MOE = ["model.preset=tiny_moe", "moe.aux_loss_coef=0.5", "moe.z_loss_coef=0.01"]
QUIET = ["checkpoint.every_steps=0", "metrics.console=false", "metrics.tensorboard=false"]
MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_load_cv", "moe_load_cv_max")


def test_sft_logs_router_losses_and_they_change_the_update(tmp_path):
    runs = {}
    for name, extra in (("with", MOE), ("without", MOE[:1])):
        recipe = load_recipe(
            "tiny_sft", sft_overrides(tmp_path / "data", tmp_path / name, "sft.max_steps=2", *QUIET, *extra)
        )
        run_sft(recipe)
        runs[name] = read_metrics(tmp_path / name)
    for metrics in runs.values():
        assert [m["step"] for m in metrics] == [1, 2]
        for m in metrics:
            assert all(math.isfinite(m[key]) for key in MOE_KEYS)
            assert 0.5 < m["moe_aux_loss"] < 2.0 and m["moe_z_loss"] > 0 and m["moe_load_cv_max"] >= m["moe_load_cv"]
    first = {k: runs["with"][0][k] for k in MOE_KEYS}
    assert first == pytest.approx({k: runs["without"][0][k] for k in MOE_KEYS})  # same weights at step 1
    assert runs["with"][0]["loss"] == pytest.approx(runs["without"][0]["loss"])  # logged loss excludes router losses
    a = load_file(str(tmp_path / "with" / "hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "without" / "hf" / "model.safetensors"))
    router = [k for k in a if k.endswith("mlp.gate.weight")]
    assert router and all(not torch.equal(a[k], b[k]) for k in router)


def test_dense_sft_logs_no_router_metrics(tmp_path):
    recipe = load_recipe("tiny_sft", sft_overrides(tmp_path / "data", tmp_path / "run", "sft.max_steps=1", *QUIET))
    run_sft(recipe)
    (m,) = read_metrics(tmp_path / "run")
    assert not set(MOE_KEYS) & m.keys()


def test_grpo_validates_on_held_out_prompts_and_logs_router_losses(tmp_path):
    held_out = write_prompts_file(tmp_path / "held_out", n=6)
    recipe = load_recipe(
        "tiny_grpo",
        grpo_overrides(
            tmp_path,
            tmp_path / "run",
            *MOE,
            f"validation.path={held_out}",
            "validation.every_steps=1",
            "validation.batch_prompts=4",
            "validation.samples_per_prompt=2",
            "checkpoint.export_hf=false",
        ),
    )
    result = run_grpo(recipe, environment=echo_environment, engine_wrapper=scripted)
    assert result.steps == 2
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(m[key]) for key in MOE_KEYS)
        assert m["val/prompts"] == 6 and 0 < m["val/accuracy"] < 1 and m["val/time_s"] > 0
    # the scripted policy ignores the weights and validation seeds do not move with the step: equal results
    keys = [k for k in metrics[0] if k.startswith("val/") and k != "val/time_s"]
    assert [metrics[0][k] for k in keys] == [metrics[1][k] for k in keys]


def test_validation_runs_at_its_cadence_and_at_the_last_step(tmp_path):
    held_out = write_prompts_file(tmp_path / "held_out", n=2)
    recipe = load_recipe(
        "tiny_grpo",
        grpo_overrides(
            tmp_path,
            tmp_path / "run",
            f"validation.path={held_out}",
            "validation.every_steps=2",
            "grpo.max_steps=3",
            "checkpoint.export_hf=false",
            "metrics.log_every=5",
        ),
    )
    run_grpo(recipe, environment=echo_environment, engine_wrapper=scripted)
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [2, 3]  # logged because they validated (log_every is 5)
    assert all("val/accuracy" in m for m in metrics)


def test_validation_refuses_a_missing_file_and_the_sft_stage(tmp_path):
    missing = f"validation.path={tmp_path}/no.jsonl"
    recipe = load_recipe("tiny_grpo", grpo_overrides(tmp_path, tmp_path / "run", missing))
    with pytest.raises(ValueError, match="validation.path: .*no.jsonl does not exist"):
        run_grpo(recipe, environment=echo_environment, engine_wrapper=scripted)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    recipe = load_recipe("tiny_grpo", grpo_overrides(tmp_path, tmp_path / "run", f"validation.path={empty}"))
    with pytest.raises(ValueError, match=r"validation.path \(.*empty.jsonl\): .*holds no prompts"):
        run_grpo(recipe, environment=echo_environment, engine_wrapper=scripted)
    with pytest.raises(ValueError, match="validation.path: in-training validation is a grpo-stage hook"):
        load_recipe("tiny_sft", ["validation.path=x.jsonl"])
    with pytest.raises(ValueError, match="validation: top_p"):
        load_recipe("tiny_grpo", ["validation.top_p=0"])


def test_summary_means_divide_reward_parts_by_scored_and_the_rest_by_all():
    sums = {
        "trajectories": 4.0,
        "scored": 2.0,
        "accuracy": 1.0,
        "reward": 1.5,
        "reward_fmt": 2.0,
        "answered": 3.0,
        "grounded": 1.0,
        "fatal_rate": 2.0,
        "turns_mean": 8.0,
        "tool_calls": 6.0,
        "no_tool_answers": 1.0,
    }
    means = summary_means(sums)
    assert means["accuracy"] == 0.5 and means["reward"] == 0.75 and means["answered"] == 0.75
    assert means["turns_mean"] == 2.0 and summary_means(summary_sums([]))["accuracy"] == 0.0
    assert means["tool_calls"] == 1.5 and means["no_tool_answers"] == 0.25


def test_without_faults_unwraps_only_an_injecting_pool(tmp_path):
    recipe = load_recipe("tiny_grpo", grpo_overrides(tmp_path, tmp_path / "run"))
    with echo_environment(recipe, 0) as env:
        assert type(env.pool).__name__ == "FaultInjectingRunner"
        clean = without_faults(env)
        assert clean.pool is env.pool.runner and type(clean) is type(env)
        assert without_faults(clean) is clean
