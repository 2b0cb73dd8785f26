"""requirements/constraints.txt is the one place the install takes its versions from: the environment the tests
run in holds exactly those versions, and every runtime dependency of pyproject.toml is pinned there."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def constraints(path: Path = ROOT / "requirements" / "constraints.txt") -> dict[str, str]:
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
            assert match, f"not an exact pin: {line!r}"
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def extra_requirements(project: dict, extra: str) -> list[Requirement]:
    """The extra's requirements, with the extras of osvl itself that it names (``osvl[wandb]``) in their place."""
    found = []
    for requirement in map(Requirement, project["optional-dependencies"][extra]):
        if canonicalize_name(requirement.name) == canonicalize_name(project["name"]):
            found += [r for name in sorted(requirement.extras) for r in extra_requirements(project, name)]
        else:
            found.append(requirement)
    return found


def test_every_runtime_and_test_dependency_is_pinned_exactly():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = [Requirement(r) for r in project["dependencies"]] + extra_requirements(project, "test")
    assert {"wandb", "mlflow-skinny", "tensorboard"} <= {canonicalize_name(r.name) for r in declared}
    pins = constraints()
    missing = [str(r) for r in declared if r.marker is None or r.marker.evaluate()]
    missing = [r for r in missing if canonicalize_name(Requirement(r).name) not in pins]
    assert not missing, f"declared but not pinned in requirements/constraints.txt: {missing}"
    outside = [
        str(r)
        for r in declared
        if canonicalize_name(r.name) in pins and pins[canonicalize_name(r.name)] not in r.specifier
    ]
    assert not outside, f"pinned outside the range pyproject.toml declares: {outside}"


def test_the_installed_environment_holds_the_pinned_versions():
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    pins = constraints()
    differ = {
        name: (pinned, installed[name])
        for name, pinned in pins.items()
        if name in installed and Version(installed[name]).public != Version(pinned).public
    }
    assert not differ, f"installed versions differ from requirements/constraints.txt (pinned, installed): {differ}"
    for numeric in ("torch", "triton", "opencv-contrib-python-headless", "tokenizers", "numpy"):
        assert numeric in pins and numeric in installed, numeric
