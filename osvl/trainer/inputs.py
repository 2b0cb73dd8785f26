"""What a recipe reads, checked before any process group starts: every path it names exists and opens as what
it must be (the checkpoint's headers and config, the tokenizer, the data and validation files, the world), so a
typo or a missing file stops a launch in seconds with one line, not as a traceback on every rank of a started
job. Reads headers and small files only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from osvl.config import Recipe


@dataclass(frozen=True)
class InputCheck:
    key: str  # the recipe key that names the path
    path: str
    problem: str = ""  # "" = it opens as it must

    def line(self) -> str:
        return f"{self.key} = {self.path}: {self.problem or 'ok'}"


def _file(key: str, path: str) -> InputCheck:
    return InputCheck(key, path, "" if Path(path).is_file() else "no such file")


def _directory(key: str, path: str) -> InputCheck:
    return InputCheck(key, path, "" if Path(path).is_dir() else "no such directory")


def _checkpoint(path: str) -> InputCheck:
    from osvl.model.checkpoint import CheckpointError, stored_tensors

    root = Path(path)
    if not root.is_dir():
        return InputCheck("model.pretrained", path, "no such directory")
    try:
        json.loads((root / "config.json").read_text(encoding="utf-8"))
        tensors = stored_tensors(root)
    except FileNotFoundError:
        return InputCheck("model.pretrained", path, "no config.json (not an HF checkpoint directory)")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return InputCheck("model.pretrained", path, f"config.json does not parse: {error}")
    except CheckpointError as error:
        return InputCheck("model.pretrained", path, str(error))
    return InputCheck("model.pretrained", path, "" if tensors else "no tensors in its safetensors files")


def _tokenizer(key: str, path: str) -> InputCheck:
    from osvl.data.tokenizer import load_tokenizer

    try:
        load_tokenizer(path)
    except ValueError as error:
        return InputCheck(key, path, str(error))
    return InputCheck(key, path)


def _world(path: str) -> InputCheck:
    from osvl.world.build import load_world

    try:
        load_world(path)
    except (ValueError, OSError) as error:
        return InputCheck("tools.world_dir", path, str(error))
    return InputCheck("tools.world_dir", path)


def check_inputs(recipe: Recipe) -> list[InputCheck]:
    """Every path the recipe names, checked (``model.pretrained`` only when the stage will read it: not when it
    resumes from a checkpoint of its own)."""
    from osvl.trainer.stage import will_resume

    data, checks = recipe.data, []
    if recipe.model.pretrained and not will_resume(recipe):
        checks.append(_checkpoint(recipe.model.pretrained))
    if data.tokenizer:
        checks.append(_tokenizer("data.tokenizer", data.tokenizer))
    elif recipe.model.pretrained:
        checks.append(_tokenizer("data.tokenizer (the checkpoint's)", recipe.model.pretrained))
    if data.train_path:
        read = _directory if Path(data.train_path).is_dir() else _file  # a parquet data set may be a directory
        checks.append(read("data.train_path", data.train_path))
    if data.image_root:
        checks.append(_directory("data.image_root", data.image_root))
    if data.system_prompt:
        checks.append(_file("data.system_prompt", data.system_prompt))
    if recipe.validation.path:
        checks.append(_file("validation.path", recipe.validation.path))
    tools = recipe.tools
    if recipe.job.stage == "grpo" and tools.backend == "offline" and tools.world_dir and not tools.servers:
        checks.append(_world(tools.world_dir))
    return checks


def input_problems(recipe: Recipe) -> list[str]:
    """One line per path that does not open as it must (empty: the stage can read everything it names)."""
    return [check.line() for check in check_inputs(recipe) if check.problem]
