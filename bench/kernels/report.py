"""The JSON result record: environment, derived per-case numbers, ratios between cases, targets."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEMA = "osvl.bench.grpo_loss/1"

# The kernels' GPU targets: (summary key, comparison, threshold).
TARGETS = {
    "logits_percent_of_issue_floor": (">=", 85.0),
    "linear_speedup_vs_liger_fused_linear": (">=", 1.3),
    "linear_peak_memory_ratio_vs_liger_fused_linear": ("<=", 0.25),
}


# The commit a run command names where the tree has no .git or the machine no git (the GPU machine
# gets a copy of the working tree without .git): OSVL_COMMIT=<sha> bash bench/device_check.sh.
COMMIT_ENV = "OSVL_COMMIT"
COMMIT_PATTERN = r"[0-9a-f]{7,40}"


def git_info(repo: Path) -> dict:
    """The commit measured: $OSVL_COMMIT when the run command names one, else git's HEAD, else none
    ('nogit'). The name given wins because the GPU machine's copy of the tree may hold a stale .git (a
    device check there once named its results after the previous session's commit). Never raises: a
    machine without git must not lose a stage's measurement to the lookup of its name."""
    named = os.environ.get(COMMIT_ENV, "")
    if re.fullmatch(COMMIT_PATTERN, named):
        return {"commit": named, "short": named[:8], "dirty": None, "source": COMMIT_ENV}
    if named:
        print(f"{COMMIT_ENV}={named!r} ignored: not 7-40 lowercase hex digits", file=sys.stderr)

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode == 0:
            commit = head.stdout.strip()
            dirty = git("diff", "--quiet", "HEAD").returncode != 0  # tracked changes; untracked files ignored
            return {"commit": commit, "short": commit[:8], "dirty": dirty, "source": "git"}
    except (OSError, subprocess.SubprocessError):  # no git binary, or git hung
        pass
    return {"commit": None, "short": "nogit", "dirty": None, "source": None}


def device_name(device: torch.device) -> str:
    import torch  # here, not at import: the device summary reads TARGETS without loading torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def device_tag(device: torch.device) -> str:
    """'cpu', or the GPU model in lower case for the file name ('NVIDIA H200' -> 'h200')."""
    if device.type != "cuda":
        return "cpu"
    tag = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return tag.removeprefix("nvidia-") or "gpu"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "liger_kernel": package_version("liger-kernel") or package_version("liger_kernel"),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def add_ratios(cases: list[dict]) -> None:
    """time_ratio_vs[x] = this median / x's median (< 1: faster than x); same for peak memory."""
    ok = [c for c in cases if c["status"] == "ok"]
    for case in ok:
        others = [o for o in ok if o is not case]
        case["time_ratio_vs"] = {o["name"]: ratio(case["median_ms"], o["median_ms"]) for o in others}
        case["memory_ratio_vs"] = {o["name"]: ratio(case["peak_extra_bytes"], o["peak_extra_bytes"]) for o in others}


def summarize(cases: list[dict], on_gpu: bool) -> dict:
    """Headline ratios; `met` is judged only on a GPU (the targets are H200 numbers), else None."""
    by_name = {c["name"]: c for c in cases if c["status"] == "ok"}

    def field(name: str, key: str):
        return by_name[name].get(key) if name in by_name else None

    def vs(name: str, other: str, key: str):
        return by_name[name][key].get(other) if name in by_name and other in by_name else None

    linear_time = vs("osvl_linear_grpo_loss", "liger_fused_linear_grpo", "time_ratio_vs")
    values = {
        "logits_percent_of_issue_floor": field("osvl_grpo_loss", "percent_of_floor"),
        "linear_speedup_vs_liger_fused_linear": None if not linear_time else 1.0 / linear_time,
        "linear_peak_memory_ratio_vs_liger_fused_linear": vs(
            "osvl_linear_grpo_loss", "liger_fused_linear_grpo", "memory_ratio_vs"
        ),
        "osvl_grpo_loss_peak_memory_ratio_vs_torch_eager": vs("osvl_grpo_loss", "torch_eager", "memory_ratio_vs"),
        "osvl_grpo_loss_time_ratio_vs_torch_eager": vs("osvl_grpo_loss", "torch_eager", "time_ratio_vs"),
        "osvl_linear_peak_memory_ratio_vs_torch_eager_linear": vs(
            "osvl_linear_grpo_loss", "torch_eager_linear", "memory_ratio_vs"
        ),
    }
    summary = {}
    for key, value in values.items():
        entry = {"value": value}
        if key in TARGETS:
            op, threshold = TARGETS[key]
            entry["target"] = f"{op} {threshold}"
            judged = on_gpu and value is not None
            entry["met"] = (value >= threshold if op == ">=" else value <= threshold) if judged else None
        summary[key] = entry
    return summary


def check_finite(record: dict) -> None:
    """Raises ValueError on a NaN/inf anywhere in the record (JSON cannot hold them faithfully)."""

    def walk(value, path: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"non-finite number at {path}: {value}")
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    walk(record, "$")


def result_path(out_dir: Path, name: str, tag: str, short_commit: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"result name must be [A-Za-z0-9_.-]+, got {name!r}")
    return out_dir / f"{name}-{tag}-{short_commit}.json"


def write_record(record: dict, path: Path) -> None:
    """Whole or not at all: a run killed mid-write leaves the previous version (and a .tmp), never half a JSON."""
    check_finite(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
