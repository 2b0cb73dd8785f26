"""python -m osvl.export: the HF model of any checkpoint step, equal to the stage's own export at its last step."""

from __future__ import annotations

import pytest
import torch

from osvl.config import load_recipe
from osvl.export import export_checkpoint, main
from osvl.model import read_hf_tensors
from osvl.trainer import run_sft
from tests.parallel.harness import run_ranks
from tests.trainer.fixtures import sft_overrides

STEPS = ["sft.max_steps=3", "checkpoint.every_steps=1", "metrics.console=false", "metrics.tensorboard=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    overrides = sft_overrides(root / "data", root / "run", *STEPS)
    run_sft(load_recipe("tiny_sft", overrides))
    return root, [x for o in overrides for x in ("--set", o)]


def test_the_last_step_exported_again_is_the_stages_own_export_and_an_earlier_step_differs(run, tmp_path, capsys):
    root, sets = run
    assert main(["--recipe", "tiny_sft", *sets, "--out", str(tmp_path / "last")]) == 0
    assert "step_00000003" in capsys.readouterr().out
    stage, again = read_hf_tensors(root / "run" / "hf"), read_hf_tensors(tmp_path / "last")
    assert stage.keys() == again.keys()
    for name in stage:
        torch.testing.assert_close(again[name], stage[name], rtol=0, atol=0, msg=name)
    assert sorted(p.name for p in (tmp_path / "last").iterdir()) == sorted(
        p.name for p in (root / "run" / "hf").iterdir()
    )
    assert (
        main(["--recipe", "tiny_sft", *sets, "--step", "2", "--out", str(tmp_path / "first")]) == 0
    )  # the run keeps 2
    first = read_hf_tensors(tmp_path / "first")
    assert any(not torch.equal(first[name], stage[name]) for name in stage)  # one more optimizer step since


def test_a_step_without_a_checkpoint_is_one_line_and_exit_2(run, tmp_path, capsys):
    _, sets = run
    assert main(["--recipe", "tiny_sft", *sets, "--step", "7", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint of step 7" in err and "step_00000003" in err, err
    assert not (tmp_path / "x").exists()


def test_average_is_the_mean_of_the_newest_checkpoints(run, tmp_path, capsys):
    root, sets = run
    for step in (2, 3):
        assert main(["--recipe", "tiny_sft", *sets, "--step", str(step), "--out", str(tmp_path / f"s{step}")]) == 0
    assert main(["--recipe", "tiny_sft", *sets, "--average", "2", "--out", str(tmp_path / "mean")]) == 0
    assert "the mean of step_00000002, step_00000003" in capsys.readouterr().out
    two, three, mean = (read_hf_tensors(tmp_path / name) for name in ("s2", "s3", "mean"))
    assert mean.keys() == three.keys()
    moved = 0
    for name in mean:
        expected = (two[name].double() + three[name].double()) / 2
        torch.testing.assert_close(mean[name].double(), expected, rtol=0, atol=1e-6, msg=name)
        moved += not torch.equal(two[name], three[name])
    assert moved  # the two checkpoints differ, so the mean is neither of them


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--average", "3"], "--average 3: 2 complete checkpoint(s)"),
        (["--average", "2", "--step", "2"], "does not combine with --step"),
    ],
)
def test_an_average_it_cannot_take_is_one_line_and_exit_2(run, tmp_path, capsys, flags, message):
    _, sets = run
    assert main(["--recipe", "tiny_sft", *sets, *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()


def _export_average_body(rank: int, world: int, overrides: list[str], out: str) -> None:
    export_checkpoint(load_recipe("tiny_sft", overrides), None, out, rank, world, average=2)


def test_two_ranks_average_their_shards_to_the_one_process_mean(run, tmp_path):
    """Each rank averages only its shards of the checkpoints (FSDP over 2 gloo ranks); the model it writes is the
    one a single process writes."""
    root, sets = run
    overrides = sets[1::2]
    assert main(["--recipe", "tiny_sft", *sets, "--average", "2", "--out", str(tmp_path / "one")]) == 0
    run_ranks(_export_average_body, 2, overrides, str(tmp_path / "two"))
    one, two = read_hf_tensors(tmp_path / "one"), read_hf_tensors(tmp_path / "two")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=0, msg=name)
