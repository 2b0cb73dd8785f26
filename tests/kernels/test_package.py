"""`osvl-kernels` is a distribution of its own (kernels/pyproject.toml): its wheel declares torch and triton only
(the host trainers are extras), holds osvl_kernels and nothing else, and every module in it imports in a process
where nothing outside the standard library, torch, triton and what they depend on can be imported; the adapters'
plugin modules, whose job is to import their host, reach for that host and nothing else first."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# Modules that import their host trainer by design (a base class, or registering in the host): the host.
HOST_BOUND = {
    "osvl_kernels.integrations.torchtitan": "torchtitan",
    "osvl_kernels.integrations.verl_plugin": "verl",
    "osvl_kernels.integrations.verl_engine_plugin": "verl",
}
# Run in a fresh interpreter with the unpacked wheel first on sys.path. The allowed top-level modules: the standard
# library, what `import torch, triton` loads, and every module of the distributions torch and triton require
# (transitively). A finder ahead of all others refuses anything else, as if it were not installed.
CHECK = r"""
import importlib, importlib.metadata as md, json, pkgutil, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

def closure(names):
    seen, todo = set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen

before = set(sys.modules)
import torch, triton
loaded = {name.split(".")[0] for name in set(sys.modules) - before}
dists = closure(["torch", "triton"])
tops = md.packages_distributions().items()
provided = {top for top, names in tops if any(canonicalize_name(n) in dists for n in names)}
allowed = set(sys.stdlib_module_names) | loaded | provided | {"torch", "triton"}
refused = []

class Refuse:
    @staticmethod
    def find_spec(name, path=None, target=None):
        top = name.split(".")[0]
        if top not in allowed and top != "osvl_kernels":
            refused.append(top)
            raise ModuleNotFoundError(f"refused: {top}", name=top)

sys.meta_path.insert(0, Refuse)
host_bound = json.loads(sys.argv[1])
import osvl_kernels
result = {"file": osvl_kernels.__file__, "modules": {}, "allowed": sorted(allowed)}
for info in pkgutil.walk_packages(osvl_kernels.__path__, "osvl_kernels."):
    refused.clear()
    try:
        importlib.import_module(info.name)
        result["modules"][info.name] = "ok"
    except ImportError as error:
        result["modules"][info.name] = f"refused {refused[0]}" if refused else repr(error)
try:
    import osvl
    result["osvl"] = "imported"
except ModuleNotFoundError:
    result["osvl"] = "refused"
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy: pip builds in the source tree (build/, *.egg-info), and two xdist workers building the
    # same tree at once break each other's build
    ignore = shutil.ignore_patterns("build", "*.egg-info")
    source = shutil.copytree(ROOT / "kernels", tmp_path_factory.mktemp("source") / "kernels", ignore=ignore)
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        str(source),
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (path,) = out.glob("osvl_kernels-0.1.0-*.whl")
    return path


def test_the_wheel_requires_torch_and_triton_only(wheel):
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read("osvl_kernels-0.1.0.dist-info/METADATA").decode()
        names = archive.namelist()
    fields = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line]
    assert ["Name", "osvl-kernels"] in fields and ["Version", "0.1.0"] in fields
    required = [Requirement(value) for key, value in fields if key == "Requires-Dist"]
    core = sorted(str(r) for r in required if r.marker is None)
    assert core == ["torch>=2.6", "triton>=3.3"]
    extras = {r.name.lower() for r in required if r.marker is not None}
    assert extras == {
        "trl",
        "transformers",
        "accelerate",
        "datasets",
        "verl",
        "peft",
        "transferqueue",
        "cachetools",
        "fastapi",
        "uvicorn",
        "torchtitan",
    }
    assert all(
        any(f'extra == "{e}"' in str(r.marker) for e in ("trl", "verl", "torchtitan")) for r in required if r.marker
    )
    packaged = {n for n in names if n.endswith(".py")}
    in_tree = {str(p.relative_to(ROOT / "kernels")) for p in (ROOT / "kernels" / "osvl_kernels").rglob("*.py")}
    assert packaged == in_tree, packaged ^ in_tree
    assert not any(n.startswith("osvl/") for n in names)


def test_every_module_imports_with_nothing_but_torch_and_triton(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {"PYTHONPATH": str(site), "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-c", CHECK, json.dumps(HOST_BOUND)]
    proc = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(site)  # the wheel's code, not the tree's editable install
    assert result["osvl"] == "refused"  # the finder works: osvl is installed here, and refused
    for name in ("osvl", "trl", "verl", "transformers", "torchtitan"):
        assert name not in result["allowed"], name
    modules = result["modules"]
    assert len(modules) >= 20 and "osvl_kernels.integrations.verl_engine" in modules
    expected = {name: f"refused {HOST_BOUND[name]}" if name in HOST_BOUND else "ok" for name in modules}
    assert modules == expected
