"""The import graph of osvl, read from the source (every import: module level, inside functions, under
TYPE_CHECKING): no module imports one that imports it back, the packages stack in one order (no import
climbs back up to a package that imports the importer), the layers under the trainer never import it,
the recipe config imports no other osvl package, and the kernels import no osvl at all. The package
table of docs/architecture.md names every package and top-level module of the tree, and only those."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the layers under the trainer (docs/architecture.md): the stages use them, they never use the stages
UNDER_THE_TRAINER = ("osvl.tools", "osvl.rollout", "osvl.rl", "osvl.data", "osvl.model")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str) -> list[tuple[str, int]]:
    """Every module name an ``import`` in the file names (``from X import y`` gives X and X.y), with its line."""
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names.append((base, node.lineno))
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the same top package: first line}}`` over ``root/package``."""
    files = {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for name, line in imported_names(path, module):
            while name and name not in files:  # `from pkg import function` names the module pkg
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """One cycle of the directed graph as ``[a, b, ..., a]``, or ``[]`` when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return [*path[path.index(succ) :], succ]
            if succ not in state and (cycle := visit(succ)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def package_of(module: str) -> str:
    """``osvl.tools.fleet`` -> ``osvl.tools``; a top-level module (``osvl.train``) is its own package."""
    return ".".join(module.split(".")[:2])


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph(ROOT, "osvl")


def test_the_graph_is_read_whole(graph):
    """The reader sees every module and imports wherever they are: module level, in functions, in ``__init__``."""
    assert len(graph) == len(list((ROOT / "osvl").rglob("*.py"))) > 150
    assert "osvl.trainer.grpo_data" in graph["osvl.trainer.grpo"]  # module level
    assert "osvl.serve.preflight" in graph["osvl.train"]  # inside a function
    assert "osvl.model.version_shims" in graph["osvl.model"]  # a package's __init__


def test_the_layers_under_the_trainer_never_import_it(graph):
    climbs = [
        f"{module} imports {target} (line {line})"
        for module, edges in graph.items()
        if any(inside(module, package) for package in UNDER_THE_TRAINER)
        for target, line in edges.items()
        if inside(target, "osvl.trainer")
    ]
    assert not climbs, "\n".join(climbs)


def test_no_module_imports_itself_back(graph):
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def test_the_packages_stack_in_one_order(graph):
    packages: dict[str, dict[str, str]] = {}
    for module, edges in graph.items():
        for target, line in edges.items():
            if package_of(target) != package_of(module):
                packages.setdefault(package_of(module), {}).setdefault(package_of(target), f"{module}:{line}")
    cycle = find_cycle(packages)
    witnesses = [f"{a} -> {b} ({packages[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    assert not cycle, "packages import each other back: " + "; ".join(witnesses)


def test_the_recipe_config_imports_no_other_osvl_package(graph):
    """Every CLI loads a recipe first: ``osvl.config`` stays free of torch, torchtitan and the rest of osvl."""
    outside = [
        f"{module} imports {target} (line {line})"
        for module, edges in graph.items()
        if inside(module, "osvl.config")
        for target, line in edges.items()
        if not inside(target, "osvl.config")
    ]
    assert not outside, "\n".join(outside)


def test_the_kernels_import_no_osvl():
    kernels = ROOT / "kernels"
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((kernels / "osvl_kernels").rglob("*.py"))
        for name, line in imported_names(path, module_name(path, kernels))
        if name == "osvl" or name.startswith("osvl.")
    ]
    assert not found, "\n".join(found)


def test_the_architecture_page_lists_the_tree():
    """Every row's ``osvl/...`` paths are the tree's packages and top-level modules, and the ``name.py``
    files a package's row describes are in that package."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("\n## Packages\n", 1)[1].split("\n#", 1)[0]
    listed, absent = set(), []
    for row in (line for line in table.splitlines() if line.startswith("| `")):
        where, what = row.split(" | ")[:2]
        for path in re.findall(r"`osvl/([\w./]+?)/?`", where):
            listed.add(path.removesuffix(".py"))
            if (ROOT / "osvl" / path).is_dir():
                absent += [f"osvl/{path}/{name}" for name in re.findall(r"`([\w/]+\.py)`", what)]
    absent = [name for name in absent if not (ROOT / name).is_file()]
    tree = {p.stem for p in (ROOT / "osvl").iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert listed == tree, f"not in the tree: {sorted(listed - tree)}; not on the page: {sorted(tree - listed)}"
    assert not absent, absent


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A lazy import that closes a circle, and one relative import, on a throwaway package."""
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from pkg.high import b\n")
    (package / "low" / "c.py").write_text("from . import a\n")
    (package / "high.py").write_text("from pkg.low.a import f\nb = f\n")
    found = import_graph(tmp_path, "pkg")
    assert found["pkg.low.a"] == {"pkg.high": 2} and found["pkg.low.c"] == {"pkg.low": 1, "pkg.low.a": 1}
    assert find_cycle(found) == ["pkg.high", "pkg.low.a", "pkg.high"]
    assert find_cycle({"x": {"y"}, "y": set()}) == []
