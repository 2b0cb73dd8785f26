"""The loader's typed validation of optional fields, and prompt files named by a config key or flag."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from osvl.config.loader import build, load_recipe, read_prompt_file
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
