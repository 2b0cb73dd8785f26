"""The SFT stage end to end: 2 gloo ranks with FSDP2 match one process, a resumed run matches an
uninterrupted one, checkpoints and the HF export exist, metrics are written every step."""

from __future__ import annotations

import json

import pytest
import torch

from osvl.config import load_recipe
from osvl.data.formats.processor import checkpoint_image_config
from osvl.model import read_hf_tensors
from osvl.trainer import read_metrics, run_sft
from tests.trainer.fixtures import sft_overrides, write_sft_data
from tests.trainer.ranks import run_ranks, sft_resume_body

STEPS = ["sft.max_steps=4", "checkpoint.every_steps=0", "metrics.console=false", "metrics.tensorboard=false"]


def _weights(run_dir):
    return read_hf_tensors(run_dir / "hf")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    a = sft_overrides(root / "data", root / "a", *STEPS)
    b = sft_overrides(root / "data", root / "b", *STEPS)
    run_ranks(sft_resume_body, 2, a, b)
    return root


def test_two_ranks_match_one_process(two_rank_runs, tmp_path):
    root = two_rank_runs
    single = run_sft(load_recipe("tiny_sft", sft_overrides(root / "data", tmp_path / "c", *STEPS)))
    assert single.steps == 4
    two, one = _weights(root / "a"), _weights(tmp_path / "c")
    assert two.keys() == one.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=key)
    losses_two = [m["loss"] for m in read_metrics(root / "a")]
    losses_one = [m["loss"] for m in read_metrics(tmp_path / "c")]
    assert losses_two == pytest.approx(losses_one, rel=1e-5)


def test_training_changes_weights_and_lowers_loss(two_rank_runs):
    metrics = read_metrics(two_rank_runs / "a")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert {"grad_norm", "lr", "tokens_per_s", "padding_frac", "step_time_s"} <= metrics[0].keys()


def test_resumed_run_matches_uninterrupted(two_rank_runs):
    root = two_rank_runs
    straight, resumed = _weights(root / "a"), _weights(root / "b")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0, msg=key)
    by_step = {m["step"]: m["loss"] for m in read_metrics(root / "b")}
    assert [by_step[s] for s in (1, 2, 3, 4)] == [m["loss"] for m in read_metrics(root / "a")]


def test_checkpoints_and_export_layout(two_rank_runs):
    run = two_rank_runs / "b"
    steps = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert steps == ["step_00000002", "step_00000004"]
    assert (run / "checkpoints" / "step_00000004" / "trainer_rank1.pt").is_file()
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    assert (run / "hf" / "tokenizer.json").is_file()
    recipe = json.loads((run / "recipe.json").read_text())
    assert recipe["job"]["name"] == "tiny_sft"
    shipped = checkpoint_image_config(run / "hf")  # the export patches images as training did
    assert shipped is not None
    assert (shipped.min_pixels, shipped.max_pixels) == (recipe["data"]["min_pixels"], recipe["data"]["max_pixels"])
    assert shipped.patch_size == config["vision_config"]["patch_size"]


def test_bad_data_paths_fail_clearly(tmp_path):
    tok, _ = write_sft_data(tmp_path / "data")
    recipe = load_recipe(
        "tiny_sft", [f"data.tokenizer={tok}", f"data.train_path={tmp_path}/none.jsonl", f"job.run_dir={tmp_path}/run"]
    )
    with pytest.raises(ValueError, match="data.train_path: .* does not exist"):
        run_sft(recipe)
    recipe = load_recipe("tiny_sft", sft_overrides(tmp_path / "data", tmp_path / "run", "sft.global_batch=64"))
    with pytest.raises(ValueError, match="sft.global_batch 64 exceeds the 8 training trajectories"):
        run_sft(recipe)
