"""``--system-prompt``: the user's file wins over the shipped prompt, and a bad file names the flag."""

from __future__ import annotations

import pytest

from osvl.eval.__main__ import read_system_prompt
from osvl.eval.modes import system_prompt


def test_no_flag_uses_the_shipped_prompt():
    shipped = read_system_prompt(None, "agent_system.v1.txt")
    assert shipped == system_prompt("agent_system.v1.txt") and shipped


def test_flag_reads_the_users_file(tmp_path):
    prompt = tmp_path / "release.txt"
    prompt.write_text("Answer inside <response>.\n", encoding="utf-8")
    assert read_system_prompt(str(prompt), "agent_system.v1.txt") == "Answer inside <response>."


def test_missing_or_empty_file_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"^--system-prompt file not found: .*gone\.txt$"):
        read_system_prompt(str(tmp_path / "gone.txt"), "direct_system.v1.txt")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match=r"^--system-prompt file .*empty\.txt is empty$"):
        read_system_prompt(str(tmp_path / "empty.txt"), "direct_system.v1.txt")
