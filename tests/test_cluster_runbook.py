"""docs/cluster.md quotes the dry run's plans for its worked examples: they are what the dry run prints today."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from osvl.config import load_recipe
from osvl.serve.__main__ import main as serve_main
from osvl.train import dry_run

RUNBOOK = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "world, quoted", [(8, ["68.3 GiB of 85.9", "59,197 tokens", "32,000 tokens"]), (64, ["54.0 GiB per rank"])]
)
def test_the_sft_plans_quoted_are_the_dry_runs(world, quoted):
    text = "\n".join(dry_run(load_recipe("sft_8b", [f"job.world_size={world}"])))
    for quote in quoted:
        assert quote in RUNBOOK
        number = quote.split(" ")[0].replace(",", "")
        assert number in text, (quote, text)


def test_the_grpo_plan_quoted_is_the_dry_run_of_the_printed_overrides(capsys):
    assert serve_main(["--recipe", "grpo_8b", "--nodes", "1", "--gpus-per-node", "8", "--train-gpus", "4"]) == 0
    [trainer] = [line for line in capsys.readouterr().out.splitlines() if " torchrun " in f" {line}"]
    sets = shlex.split(trainer.split(" --recipe grpo_8b ", 1)[1])
    overrides = [sets[i + 1] for i in range(0, len(sets), 2)]
    text = "\n".join(dry_run(load_recipe("grpo_8b", overrides)))
    for quote, printed in (
        ("51.9 GiB of 85.9", "51.9 GiB of 85.9"),
        ("74,576 tokens", "74576 tokens/rank"),
        ("77.5 GiB of KV cache", "KV cache 77.5"),
        ("30 full-length", "30 trajectories"),
    ):
        assert quote in RUNBOOK and printed in text, (quote, printed)
    assert "job.world_size=4" in trainer and "--set job.world_size=4" in RUNBOOK
