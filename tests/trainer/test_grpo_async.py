"""Asynchronous GRPO (``rollout.max_staleness = 1``) end to end on the CPU service topology: 2 gloo
trainer ranks, the SGLang-protocol loopback server process (scripted policy, the served model's own
logprobs; paused around every weight update), and two tool-server processes. The old policy is the
trainer's (recomputed) and the token-level mismatch correction is on.

One prompt is slow: each of its rollouts calls a tool that holds the call until the trainer has
logged its second step. The run must not wait for it: steps 1 and 2 complete meanwhile (else the
gate never opens and the call reports that it timed out), and when the group finally completes,
two weight syncs after it started, it is past the bound and dropped (counted and recorded), never
trained on. Every trained group's tokens are checked against the bound from their recorded versions."""

from __future__ import annotations

import functools
import math
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from osvl.rollout import RolloutRecorder
from osvl.tools import ToolEnvironment, ToolRegistry
from osvl.tools.fleet import ToolServerFleet
from osvl.trainer import read_metrics
from osvl.trainer.tool_env import with_faults
from tests.tools.fault_tools import fault_specs
from tests.trainer.gate_tool import gate_spec
from tests.trainer.grpo_fixtures import SLOW_WORD
from tests.trainer.ranks import run_ranks
from tests.trainer.test_grpo import grpo_overrides
from tests.trainer.test_grpo_services import _served_checkpoint, _start

pytestmark = pytest.mark.slow

STEPS, UPDATES = 4, 2  # rollout steps; optimizer steps (policy versions) per rollout step
RELEASE_AFTER = 2  # steps logged before the gate opens


@contextmanager
def gated_environment(recipe, rank, *, urls):
    fleet = ToolServerFleet(urls, retry_after_s=0.5)
    try:
        yield with_faults(ToolEnvironment(ToolRegistry([*fault_specs(), gate_spec()]), fleet), recipe, rank)
    finally:
        fleet.close()


def async_body(rank: int, world: int, overrides: list[str], tool_urls: tuple[str, ...]) -> None:
    from osvl.config import load_recipe
    from osvl.trainer import run_grpo

    result = run_grpo(
        load_recipe("tiny_grpo", overrides),
        rank,
        world,
        environment=functools.partial(gated_environment, urls=tool_urls),
    )
    assert result.steps == STEPS, result


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    base = grpo_overrides(root, root / "run", f"grpo.max_steps={STEPS}")
    model_dir = _served_checkpoint(root, base)
    gate = root / "gate"
    processes = []
    try:
        sglang, sglang_url = _start(
            ["-m", "tests.trainer.services", "sglang", str(model_dir), "--gated", "--ready-file", str(root / "r0")],
            root / "r0",
        )
        processes.append(sglang)
        tool_urls = []
        for ready in ("r1", "r2"):  # 4 workers each: the held calls take some, the other rollouts go on
            process, url = _start(
                ["-m", "tests.trainer.services", "tools", "--workers", "4", "--gate", str(gate)]
                + ["--ready-file", str(root / ready)],
                root / ready,
            )
            processes.append(process)
            tool_urls.append(url)
        released = []

        def open_gate() -> None:  # once step RELEASE_AFTER is logged
            metrics = root / "run" / "metrics.jsonl"
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= RELEASE_AFTER):
                if sglang.poll() is not None:
                    return
                time.sleep(0.05)
            released.append(len(metrics.read_text().splitlines()))
            gate.touch()

        threading.Thread(target=open_gate, daemon=True).start()
        overrides = base + [
            "rollout.engine=sglang",
            f'rollout.sglang_urls=["{sglang_url}"]',
            "rollout.max_logprob_diff=1e-4",
            "rollout.max_staleness=1",
            "rollout.stale_groups=drop",
            "rollout.partial_rollouts=keep",
            "grpo.old_logprobs=trainer",
            "grpo.rollout_correction=token",
            "grpo.rollout_correction_cap=2.0",
            "rollout.max_in_flight=16",
        ]
        run_ranks(async_body, 2, overrides, tuple(tool_urls))
        info = httpx.get(f"{sglang_url}/get_model_info", timeout=10, trust_env=False).json()
        yield root / "run", info, released
    finally:
        for process in processes:
            process.kill()
            process.wait(30)


def _oldest(trajectory) -> int:
    return min(min(s.versions) for s in trajectory.steps if s.token_ids)


def _gate_opened(trajectory) -> bool:
    """The first turn's gate call returned once the gate was open (or its result got an injected fault)."""
    result = trajectory.steps[0].tool_result
    return trajectory.steps[0].tool_call.name == "gate" and (
        result.text.endswith(":open") if result.ok else result.error == "injected fault"
    )


def test_every_trained_group_is_within_the_bound_and_some_are_one_sync_old(async_run):
    run, info, _ = async_run
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["policy_version"] for m in metrics] == [UPDATES * s for s in range(1, STEPS + 1)]
    assert info["weight_version"] == str(UPDATES * STEPS)
    recorder = RolloutRecorder(run / "rollouts")
    lags = []
    for step in range(1, STEPS + 1):
        trained_from = UPDATES * (step - 1)  # the trainer's version when it took the step's groups
        trajectories = [t for t in recorder.read(step) if t.steps]
        assert len(recorder.read(step)) == 16  # 4 groups x G = 4, whole
        for t in trajectories:
            lag = (trained_from - _oldest(t)) / UPDATES
            assert 0 <= lag <= 1, (step, t.prompt.id, [s.versions for s in t.steps])
            lags.append(lag)
    assert 1 in lags and 0 in lags  # the next step rolled out while the trainer trained
    assert max(m["group_lag_max"] for m in metrics) == 1 and max(m["offpolicy_token_frac"] for m in metrics) > 0


def test_the_slow_group_did_not_stall_the_steps_and_was_dropped_past_the_bound(async_run):
    run, _, released = async_run
    assert released == [RELEASE_AFTER]  # steps 1 and 2 were logged while the slow rollouts were held
    metrics = read_metrics(run)
    assert sum(m["stale_groups"] for m in metrics) >= 1
    stale = [
        t
        for step in range(1, STEPS + 1)
        if RolloutRecorder(run / "rollouts" / "stale").path(step).is_file()
        for t in RolloutRecorder(run / "rollouts" / "stale").read(step)
    ]
    held = [t for t in stale if f"code word is {SLOW_WORD}" in t.prompt.question]
    first = [t for t in held if _oldest(t) == 0]
    assert len(first) == 4 and len(held) % 4 == 0  # whole groups (G = 4), the first draw among them
    for t in held:
        assert _gate_opened(t)
        assert max(max(s.versions) for s in t.steps) >= UPDATES * RELEASE_AFTER  # answered after the gate opened
    trained = [
        t
        for step in range(1, STEPS + 1)
        for t in RolloutRecorder(run / "rollouts").read(step)
        if f"code word is {SLOW_WORD}" in t.prompt.question
    ]
    assert all(_gate_opened(t) for t in trained)  # later draws, within the bound


def test_correction_metrics_against_the_recomputed_old_policy(async_run):
    run, _, _ = async_run
    for m in read_metrics(run):
        assert m["logprob_abs_diff"] <= 1e-5, m  # the first update's ratio is 1: old = the trainer's own forward
        assert 0 < m["is_weight_mean"] <= 2.0 and 0 <= m["is_capped_frac"] <= 1
        shares = [v for k, v in m.items() if k.startswith("logprob_delta/")]
        assert len(shares) == 6 and math.isclose(sum(shares), 1.0, abs_tol=1e-9)
        assert m["mismatch_abs_diff"] >= 0 and 0 <= m["trainer_idle_frac"] <= 1 and 0 <= m["generator_idle_frac"] <= 1
    stale_steps = [m for m in read_metrics(run) if m["offpolicy_token_frac"] > 0]
    assert stale_steps and any(m["logprob_delta/lt_1e-4"] < 1 for m in stale_steps)  # older weights differ
