"""What the real-server tests that kill their server mid-step share: a mark each rank's stage leaves once
its pre-flight is done (a kill during the step's rollouts) or once it trains (a kill before the step's
weight sync), and a transport that counts the request bodies written to the server.

The killer strikes only after every rank's mark (a probe turn in flight would fail the pre-flight, a
``PreflightError``, instead of the step) and once its own requests are provably in flight: written to
the server, and too long (1500 tokens, only the length ends them) to be answered before the kill.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from osvl.rollout import EngineError, GenerationResult


def mark_preflight(marks: Path, rank: int) -> None:
    """From here on this process's stage touches ``marks/preflight-<rank>`` once its pre-flight returns
    (every probe turn answered and compared); called in the rank's own process, before ``run_grpo``."""
    import osvl.trainer.grpo as stage

    checked = stage.preflight

    def preflight_then_mark(*args, **kwargs):
        lines = checked(*args, **kwargs)
        (marks / f"preflight-{rank}").touch()
        return lines

    stage.preflight = preflight_then_mark


def hold_training_until_killed(marks: Path, rank: int) -> None:
    """From here on this process's stage touches ``marks/training-<rank>`` after its first mini-batch (the
    step's rollouts are scored by then) and holds there until ``marks/killed-0`` exists, so a kill made
    between the two falls between the step's rollouts and its weight sync."""
    import osvl.trainer.grpo as stage

    train = stage.train_minibatch

    def train_and_hold(*args, **kwargs):
        train(*args, **kwargs)
        (marks / f"training-{rank}").touch()
        assert wait_for_marks(marks, 1, timeout_s=120, name="killed"), "the server was not killed"

    stage.train_minibatch = train_and_hold


def run_until_the_server_dies(rank: int, world: int, overrides: list[str], url: str, marks: Path, at: str) -> None:
    """A rank of the GRPO stage (``tiny_grpo`` with ``overrides``) whose server is killed mid-step: ``at``
    ``"preflight"`` marks the end of its pre-flight (a kill during the rollouts), ``"training"`` holds it after its
    first mini-batch until the kill (a kill before the weight sync). The stage must fail with an ``EngineError``
    naming ``url`` on every rank."""
    from osvl.config import load_recipe
    from osvl.trainer import run_grpo
    from tests.trainer.grpo_fixtures import echo_environment

    (mark_preflight if at == "preflight" else hold_training_until_killed)(marks, rank)
    try:
        run_grpo(load_recipe("tiny_grpo", overrides), rank, world, environment=echo_environment)
    except EngineError as error:
        assert url in str(error), error
        return
    raise AssertionError(f"the step went through with its server {url} dead (killed at {at})")


def kill_once_both_ranks_train(marks: Path, server) -> None:
    """The killer of ``at="training"`` runs: SIGKILL ``server`` once both ranks hold after their first
    mini-batch, then let them go on."""
    if wait_for_marks(marks, 2, name="training"):
        server.kill()
        (marks / "killed-0").touch()


def wait_for_marks(marks: Path, ranks: int, timeout_s: float = 600, name: str = "preflight") -> bool:
    """Whether every rank's ``name`` mark (``marks/<name>-<rank>``) appeared within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not all((marks / f"{name}-{rank}").exists() for rank in range(ranks)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class CountingTransport(httpx.AsyncBaseTransport):
    """An HTTP transport that counts in ``sent`` the request bodies written to the server; with
    ``ignore_eos`` it adds ``ignore_eos`` to each body's ``sampling_params`` (SGLang's client does not
    send it, so a turn there also ends at the checkpoint's EOS)."""

    def __init__(self, ignore_eos: bool = False) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.ignore_eos = ignore_eos
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async def trace(event: str, _) -> None:
            self.sent += event == "http11.send_request_body.complete"

        body = json.loads(request.content)
        if self.ignore_eos:
            body["sampling_params"]["ignore_eos"] = True
        request = httpx.Request(
            request.method, request.url, json=body, extensions={**request.extensions, "trace": trace}
        )
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def check_killed_requests(outcomes: list, url: str) -> None:
    """The killer's requests: each was answered before the kill (a server answers a turn only once it ended,
    so a fast server may finish one between the last body written and the kill) or failed with an
    ``EngineError`` naming the dead server; at least one failed, so the kill found requests in flight."""
    failed = [o for o in outcomes if isinstance(o, EngineError)]
    assert failed and all(url in str(o) for o in failed), outcomes
    assert all(isinstance(o, EngineError | GenerationResult) for o in outcomes), outcomes
