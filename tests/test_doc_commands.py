"""Every command the documentation tells a user to type starts as typed: each Python entry point named in
README.md, docs/ and the folders' READMEs (a ```bash block's line or an inline `python ...` span) is run as a
subprocess with ``--help`` from the repository root, so a script that only imports when run one way (``python
path/x.py`` against ``python -m``) fails here, not for the user. The bash scripts parse (``bash -n``). Entry
points of other projects (``python -m verl...``) are theirs to keep."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import bash_blocks

ROOT = Path(__file__).resolve().parents[1]
OURS = ("osvl", "bench", "tests", "examples", "scripts", "kernels")
INLINE = re.compile(r"`((?:python3?|\.venv/bin/python|torchrun|bash) [^`]+)`")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("*/README.md"))]


def documented_commands() -> list[tuple[str, str]]:
    """(document, command) for every command line of the documents' bash blocks and inline spans."""
    found = []
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        lines = [c for block in bash_blocks(text) for c in block] + INLINE.findall(text)
        found += [(str(doc.relative_to(ROOT)), line) for line in lines]
    return found


def entry_point(command: str) -> tuple[str, ...] | None:
    """How to ask ``command``'s program for its help: ``("-m", module[, subcommand])``, ``("path", script[, sub])``
    or ``("bash", script)``; None for what is not one of ours (make, git, other projects' modules)."""
    for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", command):
        try:
            words = shlex.split(re.sub(r"\$\([^)]*\)", "X", part))  # a $(...) substitution is one word
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
            words = words[1:]
        if not words:
            continue
        program, rest = words[0], words[1:]
        if program == "bash" and rest and rest[0].endswith(".sh"):
            return ("bash", rest[0])
        if program.endswith("torchrun"):
            rest = rest[rest.index("-m") :] if "-m" in rest else [w for w in rest if w.endswith(".py")][:1]
        elif not (program in ("python", "python3") or program.endswith("/python")):
            continue
        while rest and rest[0] in ("-I", "-S", "-B", "-u"):
            rest = rest[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            kind, target, after = "-m", rest[1], rest[2:]
        elif rest and rest[0].endswith(".py"):
            kind, target, after = "path", rest[0], rest[1:]
        else:
            return None
        if not target.replace("/", ".").startswith(OURS):
            return None
        sub = after[:1] if after and re.fullmatch(r"[a-z][a-z_-]*", after[0]) else []
        return (kind, target, *sub)
    return None


def entry_points() -> dict[tuple[str, ...], list[str]]:
    points: dict[tuple[str, ...], list[str]] = {}
    for doc, command in documented_commands():
        point = entry_point(command)
        if point is not None:
            points.setdefault(point, []).append(f"{doc}: {command}")
    return points


def test_the_reader_finds_each_kind_of_entry_point():
    assert entry_point("OSVL_COMMIT=$(git rev-parse HEAD) bash bench/device_check.sh") == (
        "bash",
        "bench/device_check.sh",
    )
    assert entry_point("python -m osvl.synth drills --world DIR") == ("-m", "osvl.synth", "drills")
    assert entry_point("python bench/profile.py --recipe NAME") == ("path", "bench/profile.py")
    assert entry_point("torchrun --nproc_per_node N -m osvl.train --recipe NAME") == ("-m", "osvl.train")
    assert entry_point("cd x && .venv/bin/python -m osvl.report RUN") == ("-m", "osvl.report")
    assert entry_point("python -m verl.trainer.main_ppo") is None and entry_point("make demo") is None
    points = entry_points()
    assert ("-m", "osvl.train") in points and ("bash", "bench/device_check.sh") in points and len(points) > 20


@pytest.mark.parametrize("point", sorted(entry_points()), ids=lambda p: " ".join(p))
def test_every_documented_entry_point_starts_as_typed(point):
    kind, target, *sub = point
    if kind == "bash":
        proc = subprocess.run(["bash", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=30)
    else:
        argv = [sys.executable, *(["-m", target] if kind == "-m" else [target]), *sub, "--help"]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    where = "\n".join(entry_points()[point][:3])
    assert proc.returncode == 0, f"{' '.join(point)} (documented at\n{where})\nfails:\n{proc.stderr[-2000:]}"
    if kind != "bash":
        assert "usage" in proc.stdout.lower(), proc.stdout[-500:]
