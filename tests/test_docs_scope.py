"""The repository speaks of the project alone: no tracker issue numbers (a reader has no tracker), no calls of an
outside job runner, no paths outside the repository. Results under bench/results/ are records and stay as
written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = re.compile(r"\.(md|py|toml|sh|txt|json|cfg|ya?ml)$|(^|/)Makefile$")
OUTSIDE = {
    "an issue number": re.compile(r"(?:^|[\s(\[,;])#\d{1,4}\b|\b[Ii]ssues? \d+\b"),
    "an outside job runner's call": re.compile(r"\brun\(command=|\bcarry=\["),
    "a path outside the repository": re.compile(r"\.\./shared\b|(?<![\w.])/work/|\.library/"),
}


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in listed.splitlines() if TEXT.search(f) and not f.startswith("bench/results/")]


def findings(path: Path) -> list[str]:
    if path == Path(__file__):
        return []
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        found += [f"{path.relative_to(ROOT)}:{number}: {what}" for what, p in OUTSIDE.items() if p.search(line)]
    return found


def test_the_patterns_catch_what_they_are_for(tmp_path):
    for line in ("bars of #32 hold", "(#35)", "issue 2's target", 'run(command="x")', "../shared/paper/x.md"):
        probe = tmp_path / "probe.md"
        probe.write_text(f"text {line} text\n")
        assert any(p.search(probe.read_text()) for p in OUTSIDE.values()), line
    for line in ("color #ffffff", "a step #3a", "issue_floor_bytes", "/workdir", "x  # 3 seeds"):
        assert not any(p.search(line) for p in OUTSIDE.values()), line


def test_no_tracked_file_speaks_of_issue_numbers_outside_runners_or_outside_paths():
    files = tracked_text_files()
    assert len(files) > 100  # the listing found the repository
    found = [f for path in files if path.is_file() for f in findings(path)]
    assert not found, "\n".join(found[:40])
