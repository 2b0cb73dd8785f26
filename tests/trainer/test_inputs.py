"""The recipe's inputs checked before any process group: each kind of unreadable path is named with its key, a
resumed stage does not need its starting checkpoint, and a launch stops on every rank with one line on rank 0."""

from __future__ import annotations

import pytest
import torch

from osvl.config import load_recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.model import build_model, save_pretrained
from osvl.train import dry_run, main
from osvl.trainer.checkpoint import MARKER, latest_checkpoint, step_dir
from osvl.trainer.inputs import check_inputs, input_problems
from osvl.trainer.policy import policy_arch
from tests.trainer.fixtures import sft_overrides, write_sft_data


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny SFT recipe whose every input opens, with a real HF export as its starting checkpoint."""
    root = tmp_path_factory.mktemp("inputs")
    tok, _ = write_sft_data(root / "data")
    recipe = load_recipe("tiny_sft", sft_overrides(root / "data", root / "run"))
    tokenizer = load_tokenizer(tok)
    model = build_model(policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), seed=0)
    save_pretrained(model, root / "hf", dtype=torch.float32)
    (root / "prompt.txt").write_text("You are a search agent.\n")
    return root, sft_overrides(root / "data", root / "run", f"model.pretrained={root / 'hf'}")


def test_a_recipe_whose_inputs_open_has_no_problem(inputs):
    root, overrides = inputs
    recipe = load_recipe("tiny_sft", [*overrides, f"data.system_prompt={root / 'prompt.txt'}"])
    checks = check_inputs(recipe)
    keys = [c.key for c in checks]
    assert keys == ["model.pretrained", "data.tokenizer", "data.train_path", "data.system_prompt"]
    assert input_problems(recipe) == [] and all(c.line().endswith(": ok") for c in checks)


@pytest.mark.parametrize(
    "breakage, key, says",
    [
        ("no_checkpoint", "model.pretrained", "no such directory"),
        ("no_config", "model.pretrained", "no config.json"),
        ("truncated_shard", "model.pretrained", "model.safetensors"),
        ("bad_tokenizer", "data.tokenizer", "cannot parse"),
        ("no_data", "data.train_path", "no such file"),
        ("no_validation", "validation.path", "no such file"),
        ("no_world", "tools.world_dir", "not a world directory"),
    ],
)
def test_each_unreadable_input_is_named_with_its_key(inputs, tmp_path, breakage, key, says):
    root, overrides = inputs
    stage, extra = "tiny_sft", []
    if breakage in ("no_config", "truncated_shard"):
        broken = tmp_path / "hf"
        broken.mkdir()
        for f in (root / "hf").iterdir():
            (broken / f.name).write_bytes(f.read_bytes())
        if breakage == "no_config":
            (broken / "config.json").unlink()
        else:
            shard = broken / "model.safetensors"
            shard.write_bytes(shard.read_bytes()[:-100])
        extra = [f"model.pretrained={broken}", f"data.tokenizer={root / 'data' / 'tokenizer.json'}"]
    elif breakage == "no_checkpoint":
        extra = [f"model.pretrained={tmp_path / 'missing'}"]
    elif breakage == "bad_tokenizer":
        (tmp_path / "tokenizer.json").write_text("{not json")
        extra = [f"data.tokenizer={tmp_path / 'tokenizer.json'}"]
    elif breakage == "no_data":
        extra = [f"data.train_path={tmp_path / 'sft.jsonl'}"]
    elif breakage in ("no_validation", "no_world"):
        stage = "tiny_grpo"
        extra = ["model.pretrained=", f"data.tokenizer={root / 'data' / 'tokenizer.json'}"]
        extra += [f"validation.path={tmp_path / 'val.jsonl'}"] if breakage == "no_validation" else []
        extra += [f"tools.world_dir={tmp_path / 'world'}"] if breakage == "no_world" else []
    recipe = load_recipe(stage, [*overrides, *extra])
    problems = [p for p in input_problems(recipe) if p.startswith(key)]
    assert len(problems) == 1 and says in problems[0], input_problems(recipe)


def test_a_stage_that_resumes_does_not_read_its_starting_checkpoint(inputs, tmp_path):
    root, overrides = inputs
    recipe = load_recipe("tiny_sft", [*overrides, f"model.pretrained={tmp_path / 'gone'}", f"job.run_dir={tmp_path}"])
    assert input_problems(recipe) == ["model.pretrained = " + str(tmp_path / "gone") + ": no such directory"]
    step = step_dir(tmp_path / "checkpoints", 4)
    step.mkdir(parents=True)
    (step / MARKER).write_text("")  # what a finished save leaves
    assert latest_checkpoint(tmp_path / "checkpoints") == step
    assert input_problems(recipe) == []


def test_a_launch_stops_on_every_rank_before_the_process_group_with_one_line_on_rank_0(
    inputs, tmp_path, monkeypatch, capsys
):
    _, overrides = inputs
    argv = ["--recipe", "tiny_sft", *(x for o in overrides for x in ("--set", o))]
    argv += ["--set", f"data.train_path={tmp_path / 'missing.jsonl'}"]
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(argv) == 2
        err = capsys.readouterr().err
        if rank == 0:
            assert err.count("\n") == 1 and "data.train_path = " in err and "no such file" in err, err
        else:
            assert err == ""
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "run").exists()


def test_the_dry_run_lists_the_inputs_and_the_preflight_refuses_an_unreadable_one(inputs, tmp_path):
    _, overrides = inputs
    recipe = load_recipe("tiny_sft", [*overrides, f"data.train_path={tmp_path / 'missing.jsonl'}"])
    lines = dry_run(recipe)
    assert f"inputs: data.train_path = {tmp_path / 'missing.jsonl'}: no such file" in lines
    assert "inputs: 1 cannot be read: a launch stops at start-up (exit 2)" in lines
    assert any(line.startswith("inputs: model.pretrained = ") and line.endswith(": ok") for line in lines)
    with pytest.raises(ValueError, match="1 of the recipe's inputs cannot be read: data.train_path"):
        dry_run(recipe, preflight=True)
