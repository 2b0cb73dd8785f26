"""Every paper recipe holds the paper's configuration tables (tests/config/paper_tables.toml): each
keyed value equals the table's, every row is named in the recipe's comments, and no value is left
marked as an assumption the tables have since given."""

from __future__ import annotations

import tomllib
from functools import reduce
from pathlib import Path

import pytest

from osvl.config import load_recipe
from osvl.config.loader import RECIPES_DIR

TABLES = tomllib.loads((Path(__file__).parent / "paper_tables.toml").read_text())
CASES = [(table, recipe) for table in ("sft", "grpo") for recipe in TABLES[table]["recipes"]]


def _value(recipe, key: str):
    return reduce(getattr, key.split("."), recipe)


@pytest.mark.parametrize("table, name", CASES)
def test_recipe_holds_every_table_value(table, name):
    recipe = load_recipe(name)
    checked = 0
    for row in TABLES[table]["rows"]:
        if "key" not in row:
            continue
        expected = row["values"][name] if "values" in row else row["value"]
        got = _value(recipe, row["key"])
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, (
            f"{name}: {row['setting']} is {expected!r} in Table {'4' if table == 'sft' else '5'}, "
            f"{row['key']} = {got!r}"
        )
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("table, name", CASES)
def test_recipe_names_every_row_and_keeps_no_stale_assumption(table, name):
    text = (RECIPES_DIR / f"{name}.toml").read_text().lower()
    missing = [row["setting"] for row in TABLES[table]["rows"] if row["setting"].lower() not in text]
    assert not missing, f"{name} does not name these table rows: {missing}"
    assert "lost in extraction" not in text and "assumption" not in text


def test_every_row_is_keyed_mapped_or_unsupported():
    for table in ("sft", "grpo"):
        for row in TABLES[table]["rows"]:
            kinds = {"key", "mapped", "unsupported"} & row.keys()
            assert len(kinds) == 1, row
            if "values" in row:
                assert row["values"].keys() == set(TABLES[table]["recipes"]), row
