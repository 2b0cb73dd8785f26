"""The loader's typed validation of optional fields, and prompt files named by a config key or flag."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from osvl.config.loader import RECIPES_DIR, build, load_recipe, read_prompt_file, recipe_toml
from osvl.synth.pipeline import CurationConfig
from tests.fresh_imports import fresh_imports


@dataclass(frozen=True)
class Budget:
    calls: int | None = None
    label: str | int = "x"


@pytest.mark.parametrize("value", ["abc", 2.5, True, [1]])
def test_optional_int_of_the_wrong_type_is_a_value_error_naming_key_and_type(value):
    with pytest.raises(
        ValueError,
        match=r"^budget\.calls: value of the wrong type: expected int "
        r"\(or leave the key out\), got ",
    ) as error:
        build(Budget, {"calls": value}, "budget")
    assert repr(value) in str(error.value)


def test_optional_int_accepts_an_integer_or_none():
    assert build(Budget, {"calls": 3}).calls == 3
    assert build(Budget, {"calls": None}).calls is None
    assert build(Budget, {}).calls is None


def test_plain_union_names_every_option():
    assert build(Budget, {"label": 4}).label == 4
    with pytest.raises(ValueError, match=r"^label: value of the wrong type: expected str or int, got 1.5$"):
        build(Budget, {"label": 1.5})


def test_synth_solver_budget_names_the_key():
    with pytest.raises(ValueError, match=r"curation\.solver_budget: value of the wrong type: expected int"):
        build(CurationConfig, {"solver_budget": "abc"}, "curation")
    assert build(CurationConfig, {"solver_budget": 5}, "curation").solver_budget == 5


def test_recipe_type_errors_stay_value_errors(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[grpo]\ngroup_size = "eight"\n')
    with pytest.raises(ValueError, match=r"grpo\.group_size: expected an integer, got 'eight'"):
        load_recipe(recipe)


def test_read_prompt_file_strips_and_names_the_key_on_errors(tmp_path):
    prompt = tmp_path / "system.txt"
    prompt.write_text("\n  You are a search agent.  \n", encoding="utf-8")
    assert read_prompt_file(prompt, "data.system_prompt") == "You are a search agent."
    assert read_prompt_file(str(prompt), "--system-prompt") == "You are a search agent."
    with pytest.raises(ValueError, match=r"^--system-prompt file not found: .*none\.txt$"):
        read_prompt_file(tmp_path / "none.txt", "--system-prompt")
    with pytest.raises(ValueError, match=r"^data\.system_prompt file not found: "):
        read_prompt_file(tmp_path, "data.system_prompt")  # a directory is not a prompt file
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    with pytest.raises(ValueError, match=r"^data\.system_prompt file .*blank\.txt is empty$"):
        read_prompt_file(tmp_path / "blank.txt", "data.system_prompt")


def test_counting_infra_errors_needs_the_outage_rollouts_kept():
    with pytest.raises(ValueError, match="grpo: fatal_errors 'all' .* set infra_rollouts = 'keep'"):
        load_recipe("tiny_grpo", ["grpo.fatal_errors=all"])
    paper = load_recipe("tiny_grpo", ["grpo.fatal_errors=all", "grpo.infra_rollouts=keep"])
    assert (paper.grpo.fatal_errors, paper.grpo.infra_rollouts) == ("all", "keep")
    default = load_recipe("tiny_grpo")
    assert (default.grpo.fatal_errors, default.grpo.infra_rollouts) == ("policy", "drop")
    with pytest.raises(ValueError, match="grpo.infra_rollouts"):
        load_recipe("tiny_grpo", ["grpo.infra_rollouts=retry"])


def test_loading_a_recipe_imports_neither_torch_nor_torchtitan():
    """Every CLI loads a recipe first (reports, the demo's prior, summaries): the recipe and its
    ``[parallel]`` table stay torch-free, so those commands start in a fraction of a second."""
    code = "from osvl.config import load_recipe\nassert load_recipe('tiny_grpo', ['parallel.tp=1']).parallel.tp == 1"
    assert fresh_imports(code, ("torch", "torchtitan", "cv2")) == []


@pytest.mark.parametrize(
    "override, suggested",
    [
        ("grpo.eps_hgih=0.3", "grpo.eps_high"),  # a typo in its own table
        ("grpo.lr=1e-4", "optimizer.lr"),  # the right name in another table
        ("optimzer.lr=1e-4", "optimizer"),  # a mistyped table
    ],
)
def test_an_unknown_key_suggests_the_near_one(override, suggested):
    with pytest.raises(ValueError, match=rf"\(did you mean {re.escape(suggested)}\?\); accepts: "):
        load_recipe("tiny_sft", [override])


def test_an_unknown_key_in_a_file_suggests_too_and_a_far_one_suggests_nothing(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[job]\nname = "x"\nrun_dri = "runs/x"\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) job\.run_dri \(did you mean job\.run_dir\?\)"):
        load_recipe(path)
    with pytest.raises(ValueError) as error:
        load_recipe("tiny_sft", ["grpo.zzzzzz=1"])
    assert "did you mean" not in str(error.value)


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES_DIR.glob("*.toml")))
def test_the_printed_recipe_loads_back_to_the_same_recipe(name, tmp_path):
    recipe = load_recipe(name, ["grpo.eps_high=0.31", 'rollout.sglang_urls=["http://a:1", "http://b:2"]'])
    (tmp_path / "printed.toml").write_text(recipe_toml(recipe))
    assert load_recipe(tmp_path / "printed.toml") == recipe


def test_print_config_prints_the_resolved_recipe_on_rank_0_only(capsys, monkeypatch, tmp_path):
    from osvl.train import main

    assert main(["--recipe", "tiny_sft", "--set", "optimizer.lr=0.004", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "[optimizer]\n" in printed and "\nlr = 0.004\n" in printed
    (tmp_path / "again.toml").write_text(printed)
    assert load_recipe(tmp_path / "again.toml") == load_recipe("tiny_sft", ["optimizer.lr=0.004"])
    monkeypatch.setenv("RANK", "1")
    assert main(["--recipe", "tiny_sft", "--print-config"]) == 0 and capsys.readouterr().out == ""
