"""TOML files that ship inside the package (recipes, tool back-ends, curation configs), found by name.

They are package data (pyproject.toml), so ``--recipe grpo_8b``, ``--tools online`` and
``--config wikipedia_llm`` resolve the same in a clone and in an installed wheel, where no
``osvl/recipes/`` folder sits under the user's working directory.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # osvl/


def packaged_toml(name: str | os.PathLike[str], folder: str, what: str) -> Path:
    """``name`` as a path when it is one (ends in ``.toml`` or names a folder), else ``osvl/<folder>/<name>.toml``.

    ``what`` names the kind of file in the error (``recipe``, ``tools config``), which lists the
    shipped names and the nearest one to a misspelling.
    """
    path = Path(name)
    if path.suffix == ".toml" or path.parent != Path("."):
        if not path.is_file():
            raise ValueError(f"{what} file {path} does not exist")
        return path
    directory = PACKAGE_DIR / folder
    candidate = directory / f"{name}.toml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in directory.glob("*.toml"))
    near = difflib.get_close_matches(str(name), known, n=2, cutoff=0.75)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    raise ValueError(f"unknown {what} {str(name)!r}{hint}; known: {', '.join(known)} (or pass a .toml path)")
