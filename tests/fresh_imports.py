"""What a fresh interpreter leaves imported: the tests that keep CLIs and tool workers light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fresh_imports(code: str, watched: tuple[str, ...]) -> list[str]:
    """Runs ``code`` in a new interpreter at the repository root and returns the loaded modules that
    are, or live under, one of ``watched`` (``"torch"`` matches ``torch.nn``), sorted."""
    report = (
        "\nimport json as _json, sys as _sys\n"
        f"_watched = {watched!r}\n"
        "print(_json.dumps(sorted(m for m in _sys.modules if any(m == w or m.startswith(w + '.') for w in _watched))))"
    )
    done = subprocess.run([sys.executable, "-c", code + report], cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
