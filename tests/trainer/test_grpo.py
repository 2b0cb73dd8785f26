"""The GRPO stage end to end on 2 gloo ranks (FSDP2): a scripted policy with real logprobs, echo
tools with injected faults; checks the loss, the update, the metrics, fatal masking and the clamp."""

from __future__ import annotations

import math

import pytest
import torch

from osvl.config import load_recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.model import read_hf_tensors, save_pretrained
from osvl.rollout import RolloutRecorder
from osvl.trainer import read_metrics, run_grpo
from osvl.trainer.policy import build_policy, policy_arch
from osvl.trainer.validation import answer_is_grounded
from tests.trainer.fixtures import write_sft_data
from tests.trainer.grpo_fixtures import echo_environment, scripted, write_prompts_file
from tests.trainer.ranks import grpo_body, run_ranks


def grpo_overrides(root, run_dir, *extra: str) -> list[str]:
    tok, _ = write_sft_data(root / "data")
    prompts = write_prompts_file(root / "data")
    return [
        f"data.tokenizer={tok}",
        f"data.train_path={prompts}",
        f"job.run_dir={run_dir}",
        "model.pretrained=",
        "grpo.max_steps=2",
        "grpo.batch_prompts=4",
        "grpo.mini_batch_prompts=2",
        "grpo.group_size=4",
        "grpo.max_response_tokens=64",
        "grpo.max_prompt_tokens=512",
        "rollout.max_turns=4",
        "tools.fault_rate=0.3",
        "checkpoint.every_steps=0",
        "metrics.console=false",
        "metrics.tensorboard=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    overrides = grpo_overrides(root, root / "run")
    run_ranks(grpo_body, 2, overrides)
    return root, overrides


def test_metrics_written_and_finite(two_rank_run):
    root, _ = two_rank_run
    metrics = read_metrics(root / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in (
            "loss",
            "reward",
            "accuracy",
            "fatal_rate",
            "clamped_frac",
            "clip_frac",
            "kl",
            "entropy",
            "logprob_abs_diff",
            "tokens_per_s",
            "padding_frac",
            "time_rollout_s",
            "time_tools_s",
            "time_advantages_s",
            "time_pack_s",
            "time_train_s",
            "time_sync_s",
            "memory_peak_gib",
        ):
            assert math.isfinite(m[key]), (key, m[key])
    assert metrics[0]["policy_version"] == 2 and metrics[1]["policy_version"] == 4  # 2 mini-batches a step
    for m in metrics:  # every update applied; the loop's spans are parts of the step
        spans = ("time_rollout_s", "time_advantages_s", "time_pack_s", "time_train_s", "time_sync_s")
        assert m["nonfinite_skipped"] == 0 and sum(m[k] for k in spans) <= m["step_time_s"]
    # step 1 trains on the weights that generated it: the engine's logprobs are the trainer's
    assert metrics[0]["logprob_abs_diff"] < 1e-4
    assert 0 < metrics[0]["accuracy"] < 1 and metrics[0]["entropy"] > 0
    # the share of answers a tool observation states, over the step's recorded rollouts (both ranks')
    for step, m in enumerate(metrics, start=1):
        rollouts = RolloutRecorder(root / "run" / "rollouts").read(step)
        assert m["grounded"] == pytest.approx(sum(map(answer_is_grounded, rollouts)) / len(rollouts))


def test_fatal_masking_and_clamp_exercised(two_rank_run):
    root, _ = two_rank_run
    metrics = read_metrics(root / "run")
    assert all(m["fatal"] > 0 and m["clamped"] > 0 for m in metrics)
    trajectories = RolloutRecorder(root / "run" / "rollouts").read(1)
    assert len(trajectories) == 16  # 4 prompts x G=4, from both ranks
    fatal = [t for t in trajectories if t.fatal_step >= 0]
    assert fatal and all(t.reward.acc == 0.0 for t in fatal)
    recorded = [t for step in (1, 2) for t in RolloutRecorder(root / "run" / "rollouts").read(step)]
    statuses = {s.tool_result.error for t in recorded for s in t.steps if s.tool_result is not None}
    assert "injected fault" in statuses  # fault draws are seeded per step: look over the whole run


def test_parameters_change(two_rank_run, tmp_path):
    root, overrides = two_rank_run
    recipe = load_recipe("tiny_grpo", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    save_pretrained(
        build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1),
        tmp_path / "init",
        dtype=torch.float32,
    )  # the same seeded initialisation the run started from
    initial = read_hf_tensors(tmp_path / "init")
    trained = read_hf_tensors(root / "run" / "hf")
    assert trained.keys() == initial.keys()
    changed = [k for k in trained if not torch.equal(trained[k], initial[k])]
    language = [k for k in trained if not k.startswith("model.visual")]
    assert language and set(language) <= set(changed)  # the prompts carry no images: only the filler saw the tower


def test_single_process_hard_mask_drops_fatal(tmp_path, two_rank_run):
    root, _ = two_rank_run
    recipe = load_recipe(
        "tiny_grpo",
        grpo_overrides(
            root, tmp_path / "run", "grpo.fatal_mode=hard_mask", "grpo.max_steps=1", "checkpoint.export_hf=false"
        ),
    )
    result = run_grpo(recipe, environment=echo_environment, engine_wrapper=scripted)
    assert result.steps == 1 and math.isfinite(result.final_loss)
    (m,) = read_metrics(tmp_path / "run")
    assert m["fatal"] > 0 and m["dropped"] >= m["fatal"]
    # hard_mask trains on fewer tokens than the sequences hold: the fatal ones are gone
    rollouts = RolloutRecorder(tmp_path / "run" / "rollouts").read(1)
    policy_tokens = sum(len(s.token_ids) for t in rollouts for s in t.steps)
    assert m["train_tokens"] < policy_tokens


@pytest.mark.parametrize(("errors", "infra_rollouts"), [("policy", "drop"), ("all", "keep")])
def test_outage_hit_rollouts_are_dropped_or_kept_as_the_recipe_says(tmp_path, two_rank_run, errors, infra_rollouts):
    root, _ = two_rank_run
    outage = [
        "tools.fault_rate=0",
        "tools.outage_rate=1",
        "tools.outage_start_turns=1",
        'tools.outage_tools=["echo"]',
        f"grpo.fatal_errors={errors}",
        f"grpo.infra_rollouts={infra_rollouts}",
        "grpo.max_steps=1",
        "checkpoint.export_hf=false",
    ]
    recipe = load_recipe("tiny_grpo", grpo_overrides(root, tmp_path / "run", *outage))
    run_grpo(recipe, environment=echo_environment, engine_wrapper=scripted)
    (m,) = read_metrics(tmp_path / "run")
    rollouts = RolloutRecorder(tmp_path / "run" / "rollouts").read(1)
    hit = [
        t
        for t in rollouts
        if any(s.tool_result is not None and s.tool_result.error and "back-end" in s.tool_result.error for s in t.steps)
    ]
    assert hit and m["infra_hit"] == len(hit) and m["tool_calls_mean"] > 0
    if infra_rollouts == "keep":
        assert m["infra_kept"] == len(hit) and m["infra_dropped"] == 0 and all(t.reward.scored for t in hit)
    else:
        assert m["infra_dropped"] == len(hit) and m["infra_kept"] == 0 and not any(t.reward.scored for t in hit)


def test_bad_grpo_inputs_fail_clearly(tmp_path, two_rank_run):
    root, _ = two_rank_run
    recipe = load_recipe("tiny_grpo", grpo_overrides(root, tmp_path / "r", f"data.train_path={tmp_path}/none.jsonl"))
    with pytest.raises(ValueError, match="data.train_path: .* does not exist"):
        run_grpo(recipe, environment=echo_environment)
    recipe = load_recipe(
        "tiny_grpo", grpo_overrides(root, tmp_path / "r", "grpo.batch_prompts=16", "grpo.mini_batch_prompts=16")
    )
    with pytest.raises(ValueError, match="grpo.batch_prompts 16 exceeds the 8 RL prompts"):
        run_grpo(recipe, environment=echo_environment)
    recipe = load_recipe("tiny_grpo", grpo_overrides(root, tmp_path / "r", "tools.world_dir="))
    with pytest.raises(ValueError, match="tools.world_dir must name"):
        run_grpo(recipe)
