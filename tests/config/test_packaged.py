"""Shipped TOML files resolve by name from any working directory; paths stay paths; a misspelt name is one
clear error naming the shipped ones and the nearest."""

from __future__ import annotations

import pytest

from osvl.config.packaged import PACKAGE_DIR, packaged_toml
from osvl.synth.run_config import read_toml
from osvl.tools.config_file import read_tools_file


def test_a_name_finds_the_shipped_file_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no osvl/ folder under the working directory, as after pip install
    assert packaged_toml("online", "recipes/tools", "tools config") == PACKAGE_DIR / "recipes/tools/online.toml"
    assert {"text_search", "image_search"} <= set(read_tools_file("online"))
    assert {"source", "llm", "stages"} <= set(read_toml("wikipedia_llm"))  # parsed, not just found


def test_a_path_is_taken_as_given(tmp_path):
    mine = tmp_path / "online.toml"  # the same stem as a shipped file: the path wins
    mine.write_text("[text_search]\nbackend = 'offline'\n")
    assert packaged_toml(mine, "recipes/tools", "tools config") == mine
    assert read_tools_file(mine) == {"text_search": {"backend": "offline"}}
    with pytest.raises(ValueError, match="tools config file .*missing.toml does not exist"):
        packaged_toml(tmp_path / "missing.toml", "recipes/tools", "tools config")


def test_a_misspelt_name_suggests_the_nearest():
    with pytest.raises(ValueError, match=r"unknown tools config 'onlin' \(did you mean online\?\); known: .*online"):
        read_tools_file("onlin")
    with pytest.raises(ValueError, match=r"unknown curation config 'wikipedia' \(did you mean wikipedia_llm\?\)"):
        read_toml("wikipedia")
