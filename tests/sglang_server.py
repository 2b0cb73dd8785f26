"""Real SGLang servers and a real sglang-router for the tests marked ``sglang``, from their own venv
(``make sglang-venv``: ``.venv-sglang``, or the python named by ``OSVL_SGLANG_PYTHON``). A missing
venv fails the test, never skips it.

SGLang 0.5.23 serves on a CPU-only machine with two things a GPU cluster needs neither of:
``SGLANG_USE_CPU_ENGINE=1`` (its CPU mode; ``--device cpu`` alone does not switch it) and the
venv's ``cpu-shim`` directory on ``PYTHONPATH``, which holds an empty ``common_ops`` module so that
``sgl_kernel`` imports (its wheels ship CUDA ops only; the CPU paths then run plain torch).
Each server runs in its own process group, so ``kill()`` takes its scheduler and detokenizer down
with it, as a crashed node would go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from osvl.rollout.vllm_process import free_port

ROOT = Path(__file__).resolve().parents[1]
KV_TOKENS = 8192  # SGLang's default sizes the KV cache from host memory (a 14 GB cache on this machine kind)


def sglang_python() -> Path:
    python = Path(os.environ.get("OSVL_SGLANG_PYTHON") or ROOT / ".venv-sglang" / "bin" / "python")
    if not python.is_file():
        pytest.fail(
            f"the SGLang venv is missing ({python}): `make sglang-venv` installs SGLang and sglang-router "
            f"(requirements/sglang-cpu.txt) and the CPU shim for the tests marked sglang; `make test` does it first"
        )
    return python


def _environment(python: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=str(python.parent.parent / "cpu-shim"),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


class _Process:
    """A server process in its own session, its output in ``log``, up once ``ready_path`` answers 200."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, ready_path: str, startup_s: float) -> None:
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            argv, cwd=log.parent, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.started_s = self._wait(ready_path, startup_s)

    def _wait(self, path: str, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                self.close()
                raise RuntimeError(f"{self.log.name}: exited with code {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}{path}", timeout=5, trust_env=False).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.close()
        raise RuntimeError(f"{self.log.name}: {path} not 200 within {timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def _signal_group(self, sig: int) -> None:
        """Its whole process group: children live on when the server itself has exited at start."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the server and its child processes at once."""
        self._signal_group(signal.SIGKILL)
        self.process.wait(60)

    def close(self) -> None:
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.process.wait(60)
        self._log_file.close()


class SGLangServer(_Process):
    """``python -m sglang.launch_server`` over ``model_dir`` on CPU, float32 (the trainer's dtype in
    these tests), up once ``/health`` answers (SGLang's health route runs a one-token probe)."""

    def __init__(self, model_dir: Path, log: Path, *extra: str, port: int = 0, startup_s: float = 900.0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        python = sglang_python()
        argv = [
            str(python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-total-tokens",
            str(KV_TOKENS),
            "--random-seed",
            "0",
            *extra,
        ]
        super().__init__(argv, _environment(python), log, "/health", startup_s)


class SGLangRouter(_Process):
    """sglang-router (round robin) over ``workers``, up once it has registered them (``/readiness``:
    its ``/health`` is 200 before any worker is)."""

    def __init__(self, workers: list[str], log: Path, startup_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        python = sglang_python()
        argv = [
            str(python),
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            "round_robin",
            "--worker-urls",
            *workers,
        ]
        super().__init__(argv, _environment(python), log, "/readiness", startup_s)
