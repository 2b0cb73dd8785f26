"""The recipes ship inside the osvl wheel: a wheel built from a copy of the source, unpacked away from the
checkout, resolves every recipe, the tool back-ends file and the curation config by name (what ``pip install
osvl`` gives a user, who has no ``osvl/`` folder of a clone to point at)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from osvl.config.loader import RECIPES_DIR

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def test_the_wheel_ships_every_recipe_and_loads_it_by_name(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "osvl", source / "osvl", ignore=SKIP)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w", "dist"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("osvl-*.whl")
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))
    assert len(names) >= 10
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    assert {f"osvl/recipes/{n}.toml" for n in names} | {
        "osvl/recipes/tools/online.toml",
        "osvl/synth/configs/wikipedia_llm.toml",
    } <= shipped

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import sys, osvl; from osvl.config import load_recipe; "
        "print(osvl.__file__); print(' '.join(load_recipe(n).job.name for n in sys.argv[1:])); "
        "from osvl.tools.config_file import read_tools_file; from osvl.synth.run_config import read_toml; "
        "print(sorted(read_tools_file('online')), sorted(read_toml('wikipedia_llm')))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    shown = subprocess.run(
        [sys.executable, "-c", probe, *names], cwd=elsewhere, env=env, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert Path(shown[0]).is_relative_to(tmp_path / "site")  # the unpacked wheel, not the checkout
    assert len(shown[1].split()) == len(names)
    assert (
        shown[2] == "['http', 'image_search', 'text_search'] ['budget', 'curation', 'llm', 'source', 'stages', 'tools']"
    )  # the tool and curation files
