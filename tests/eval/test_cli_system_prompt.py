"""The system turn osvl.eval shows: a checkpoint osvl exported gets the prompt and tool schema it was
trained with, ``--system-prompt`` replaces the prompt (an empty file: none), other checkpoints get the
mode's shipped prompt; ``--tool-profile`` defaults to the profile of the tools the export was trained on."""

from __future__ import annotations

import dataclasses

import pytest

from osvl.data.chat_template import chat_template
from osvl.eval.__main__ import read_system_prompt, resolve_tool_profile, system_turn
from osvl.eval.model_dir import load_model_dir
from osvl.eval.modes import system_prompt
from osvl.tools import tool_profile

RELEASE = tool_profile("release").tool_schemas()
PAPER = tool_profile("paper").tool_schemas()


def test_no_flag_reads_nothing_and_the_users_file_is_read(tmp_path):
    assert read_system_prompt(None) is None
    prompt = tmp_path / "release.txt"
    prompt.write_text("Answer inside <response>.\n", encoding="utf-8")
    assert read_system_prompt(str(prompt)) == "Answer inside <response>."
    (tmp_path / "empty.txt").write_text("  \n")
    assert read_system_prompt(str(tmp_path / "empty.txt")) == ""  # explicitly no system prompt
    with pytest.raises(ValueError, match=r"^--system-prompt file not found: .*gone\.txt$"):
        read_system_prompt(str(tmp_path / "gone.txt"))


@pytest.fixture
def exported(checkpoint):
    """The session checkpoint as if osvl had exported it with the release profile and a system prompt."""
    model_dir = load_model_dir(checkpoint)
    assert model_dir.trained_prompt is None  # a foreign (hand-written ChatML) template says nothing
    template = chat_template("Trained prompt.", RELEASE)
    return dataclasses.replace(model_dir, chat_template=template, trained_prompt=("Trained prompt.", RELEASE))


def test_foreign_checkpoints_get_the_shipped_prompt_and_the_offered_tools(checkpoint, tmp_path):
    model_dir = load_model_dir(checkpoint)
    turn = system_turn("agentic", model_dir, None, PAPER)
    assert (turn.prompt, turn.tools, turn.source) == (system_prompt("agent_system.v1.txt"), PAPER, "shipped")
    turn = system_turn("direct", model_dir, None, [])
    assert (turn.prompt, turn.tools) == (system_prompt("direct_system.v1.txt"), [])
    (tmp_path / "empty.txt").write_text("")
    turn = system_turn("rag", model_dir, str(tmp_path / "empty.txt"), PAPER)
    assert (turn.prompt, turn.tools, turn.source) == ("", [], "file")
    assert resolve_tool_profile(None, model_dir, python_interpreter=False) == "paper"


def test_an_osvl_export_gets_its_own_prompt_and_schema(exported, tmp_path):
    turn = system_turn("agentic", exported, None, PAPER)  # the schema it was trained on, not the offered one
    assert (turn.prompt, turn.tools, turn.source) == ("Trained prompt.", RELEASE, "checkpoint")
    assert system_turn("direct", exported, None, []).tools == []  # no tools in the direct workflow
    (tmp_path / "mine.txt").write_text("Mine.")
    (tmp_path / "empty.txt").write_text("\n")
    assert system_turn("agentic", exported, str(tmp_path / "mine.txt"), PAPER).prompt == "Mine."
    turn = system_turn("agentic", exported, str(tmp_path / "empty.txt"), PAPER)
    assert (turn.prompt, turn.tools, turn.source) == ("", RELEASE, "file")


def test_tool_profile_follows_the_exported_schema(exported):
    assert resolve_tool_profile(None, exported, python_interpreter=False) == "release"
    assert resolve_tool_profile("release", exported, python_interpreter=False) == "release"
    with pytest.raises(ValueError, match=r"--tool-profile paper does not offer \[.*'web_search'.*trained to call"):
        resolve_tool_profile("paper", exported, python_interpreter=False)
    unknown = dataclasses.replace(
        exported, trained_prompt=("", [{"type": "function", "function": {"name": "teleport"}}])
    )
    with pytest.raises(ValueError, match=r"trained with tools \['teleport'\].*which no tool profile"):
        resolve_tool_profile(None, unknown, python_interpreter=False)
    paper_export = dataclasses.replace(exported, trained_prompt=("", []))  # the paper profile shows no schema
    assert resolve_tool_profile(None, paper_export, python_interpreter=False) == "paper"
