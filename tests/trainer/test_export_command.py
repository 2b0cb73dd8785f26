"""python -m osvl.export: the HF model of any checkpoint step, equal to the stage's own export at its last step."""

from __future__ import annotations

import pytest
import torch

from osvl.config import load_recipe
from osvl.export import main
from osvl.model import read_hf_tensors
from osvl.trainer import run_sft
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
