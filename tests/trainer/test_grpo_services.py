"""The GRPO stage on the serving topology, end to end on CPU over the real protocols: 4 steps of
``tiny_grpo_services`` on 2 gloo trainer ranks, with an SGLang-protocol server process (the loopback
server over a checkpoint, scripted policy with the served model's own logprobs), an OpenAI-compatible
judge process with an outage on one question, and two tool-server processes, all kept up by
``osvl.serve.supervisor`` as ``osvl.serve --launch`` keeps its services. Each service kind is killed (-9) in
turn: tool server A after step 1, the judge after step 2, the SGLang server after step 3; the
supervisor restarts each, and the run ends with its 4 steps, the restarted engine serving the
trainer's weights again."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from osvl.config import load_recipe
from osvl.data.formats.processor import PREPROCESSOR_FILE
from osvl.data.tokenizer import load_tokenizer
from osvl.model import build_model, save_pretrained
from osvl.rl.trajectory import ToolStatus
from osvl.rollout import RolloutRecorder
from osvl.serve.supervisor import RestartPolicy, ServiceSpec, Supervisor
from osvl.tools import ToolEnvironment, ToolRegistry
from osvl.tools.fleet import ToolServerFleet
from osvl.trainer import read_metrics
from osvl.trainer.policy import policy_arch, policy_image_config
from osvl.trainer.tool_env import with_faults
from tests.tools.fault_tools import fault_specs
from tests.trainer.ranks import run_ranks
from tests.trainer.test_grpo import grpo_overrides

pytestmark = pytest.mark.slow

OUTAGE = "code word is delta"  # the judge answers 503 for this question's samples
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
KILLED_AFTER = {1: "tools a", 2: "judge", 3: "sglang"}  # step logged -> the service killed then


def _start(argv: list[str], ready: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'kernels'}"}
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ready.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{argv} did not come up (exit code {process.poll()})")
        time.sleep(0.1)
    return process, ready.read_text()


@contextmanager
def fleet_environment(recipe, rank, *, urls):
    """The echo/refuse tools, served by the tool-server processes, behind the stage's fault injector."""
    fleet = ToolServerFleet(urls, retry_after_s=0.5)
    try:
        yield with_faults(ToolEnvironment(ToolRegistry(fault_specs()), fleet), recipe, rank)
    finally:
        fleet.close()


def services_body(rank: int, world: int, overrides: list[str], tool_urls: tuple[str, ...]) -> None:
    from osvl.trainer import run_grpo

    result = run_grpo(
        load_recipe("tiny_grpo_services", overrides),
        rank,
        world,
        environment=functools.partial(fleet_environment, urls=tool_urls),
    )
    assert result.steps == STEPS, result


def _served_checkpoint(root: Path, overrides: list[str]) -> Path:
    """A checkpoint of the trainer's architecture with other weights: the stage pushes its own at start."""
    recipe = load_recipe("tiny_grpo", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    arch = policy_arch(recipe, tokenizer.vocab_size, tokenizer.special)
    torch.manual_seed(7)
    directory = root / "served"
    save_pretrained(build_model(arch), directory, dtype=torch.float32)
    tokenizer.save(directory / "tokenizer.json")
    (directory / PREPROCESSOR_FILE).write_text(json.dumps(policy_image_config(recipe, arch).to_preprocessor_config()))
    return directory


@pytest.fixture(scope="module")
def services_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("services")
    base = grpo_overrides(root, root / "run", f"grpo.max_steps={STEPS}", "model.preset=tiny")
    model_dir = _served_checkpoint(root, base)
    python = (sys.executable, "-m")
    tools = (*python, "tests.trainer.services", "tools")
    specs = [
        ServiceSpec("sglang", (*python, "tests.trainer.services", "sglang", str(model_dir))),
        ServiceSpec("tools a", tools),
        ServiceSpec("tools b", tools),
        ServiceSpec("judge", (*python, "osvl.serve.loopback_judge")),
    ]
    log: list[str] = []
    supervisor = Supervisor(specs, root, RestartPolicy(first_delay_s=0.5), log=log.append)
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{ROOT}:{ROOT / 'kernels'}"  # the services import tests.* and osvl_kernels
    stop = threading.Event()
    supervising = threading.Thread(target=supervisor.run, args=(stop, 0.1), daemon=True)
    try:
        sglang_url, url_a, url_b, judge_url = supervisor.start()
        supervising.start()
        httpx.post(judge_url.removesuffix("/v1") + "/admin/outage", json={"status": 503, "match": OUTAGE}, timeout=10)
        killed: dict[int, int] = {}  # step -> pid killed after it

        def kill_in_turn() -> None:
            metrics = root / "run" / "metrics.jsonl"
            for step, name in KILLED_AFTER.items():
                while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= step):
                    if stop.is_set():
                        return
                    time.sleep(0.05)
                service = next(s for s in supervisor.services if s.spec.name == name)
                killed[step] = service.process.pid
                os.kill(service.process.pid, signal.SIGKILL)

        threading.Thread(target=kill_in_turn, daemon=True).start()
        overrides = base + [
            "rollout.engine=sglang",
            f'rollout.sglang_urls=["{sglang_url}"]',
            "rollout.max_logprob_diff=1e-4",
            "judges.accuracy=llm",
            "judges.query=llm",
            f"judges.url={judge_url}",
            "judges.model=loopback-judge",
            "judges.max_attempts=2",
            "judges.overload_wait_s=1",  # the outage answers 503: overload, waited out this long
            "judges.timeout_s=30",
        ]
        run_ranks(services_body, 2, overrides, (url_a, url_b))
        info = httpx.get(f"{sglang_url}/get_model_info", timeout=10).json()
        yield root, info, killed, log
    finally:
        stop.set()
        supervising.join(120)
        supervisor.stop()
        if previous is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = previous


def test_every_service_killed_in_turn_was_restarted_and_the_run_took_its_steps(services_run):
    root, _, killed, log = services_run
    assert sorted(killed) == [1, 2, 3]
    for step, name in KILLED_AFTER.items():
        assert any(line.startswith(f"{name} (pid {killed[step]}) ended with signal SIGKILL") for line in log), log
        assert any(line.startswith(f"{name} is back at ") for line in log), log
    assert [m["step"] for m in read_metrics(root / "run")] == [1, 2, 3, 4]


def test_server_version_follows_the_optimizer_and_parity_holds_after_every_sync(services_run):
    """Also after the SGLang server's restart: it came back on its checkpoint and got the trainer's
    weights (version 6, from the last disk sync) before it generated step 4's tokens."""
    root, info, _, _ = services_run
    metrics = read_metrics(root / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["policy_version"] for m in metrics] == [2, 4, 6, 8]  # 2 mini-batches (optimizer steps) a step
    assert info["weight_version"] == "8"
    assert info["model_path"].endswith("weights/v000008")  # the stage's last disk sync
    for m in metrics:
        assert m["logprob_abs_diff"] <= 1e-4, m  # engine logprobs = trainer's on the weights that generated them
        assert m["sync_bytes"] > 0 and m["sync_s"] > 0
    assert sum(m["engine_restarts"] for m in metrics) >= 1 and metrics[-1]["engine_restarts"] >= 1
    recorder = RolloutRecorder(root / "run" / "rollouts")
    for step in (1, 2, 3, 4):
        versions = {s.policy_version for t in recorder.read(step) for s in t.steps}
        assert versions == {2 * (step - 1)}, (step, versions)  # every token came from the synced weights


def test_a_judge_outage_leaves_samples_unscored_never_zero(services_run):
    """Steps 1 and 2, before the judge's restart (which ended its outage)."""
    root, _, _, _ = services_run
    recorder = RolloutRecorder(root / "run" / "rollouts")
    trajectories = [t for step in (1, 2, 3, 4) for t in recorder.read(step)]
    before_restart = [t for step in (1, 2) for t in recorder.read(step)]
    hit = [
        t
        for t in before_restart
        if OUTAGE in t.prompt.question and t.steps and t.reward.unscored_reason != "infra_error"
    ]
    spared = [
        t
        for t in before_restart
        if OUTAGE not in t.prompt.question and t.steps and t.reward.unscored_reason != "infra_error"
    ]
    assert hit and spared
    assert all(
        t.reward.total is None and "http_503" in t.reward.unscored_reason
        for t in hit
        if not (t.fatal_step >= 0 or t.final_answer is None)
    )  # fatal/unanswered: r_acc = 0 by rule
    assert all(t.reward.total is not None for t in spared if t.reward.unscored_reason is None)
    metrics = read_metrics(root / "run")
    assert sum(m["unscored"] for m in metrics) == sum(
        t.reward.total is None and t.reward.unscored_reason != "infra_error" for t in trajectories
    )
    assert all(m["judge_requests"] > 0 and m["judge_p99_s"] >= m["judge_p50_s"] >= 0 for m in metrics)


def test_a_killed_tool_server_gives_typed_infra_errors_and_rejoins_once_restarted(services_run):
    root, _, _, _ = services_run
    recorder = RolloutRecorder(root / "run" / "rollouts")
    later = [s.tool_result for step in (2, 3, 4) for t in recorder.read(step) for s in t.steps if s.tool_result]
    failed = [r for r in later if r.status is ToolStatus.INFRA_ERROR]
    assert failed and all("tool server" in (r.error or "") for r in failed)
    assert any(r.status is ToolStatus.OK for r in later)  # the surviving server kept serving
    metrics = read_metrics(root / "run")
    assert sum(m["tool_server_restarts"] for m in metrics) >= 1  # server a came back as a new process
    assert all(m["tool_calls_overloaded"] == m["tool_overload_failures"] == 0 for m in metrics)


def sync_paths_body(rank: int, world: int, overrides: list[str], disk_url: str, dist_url: str, weights: str) -> None:
    """One sync of the FSDP-sharded policy through each path (collective on both ranks)."""
    import asyncio

    from osvl.rollout import SGLangConfig, SGLangEngine
    from osvl.rollout.weight_sync import DiskSync, DistributedSync
    from osvl.trainer.policy import build_policy

    recipe = load_recipe("tiny_grpo", overrides)
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    model = build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), world)
    with asyncio.Runner() as runner:
        DiskSync(SGLangEngine(SGLangConfig((disk_url,))), weights, torch.float32, runner.run).sync(model, 5)
        broadcast = DistributedSync(
            SGLangEngine(SGLangConfig((dist_url,))),
            torch.float32,
            runner.run,
            bucket_bytes=1 << 16,
            master_address="127.0.0.1",
        )
        broadcast.sync(model, 5)
        broadcast.close()


def test_disk_and_distributed_sync_of_fsdp_shards_give_identical_server_weights(tmp_path):
    from osvl.model import from_pretrained
    from osvl.serve.loopback_engine import LoopbackServer, engine_from_checkpoint

    overrides = grpo_overrides(tmp_path, tmp_path / "run", "model.preset=small")
    served = _served_checkpoint(tmp_path, overrides)  # seed-7 weights; the policy is seeded by job.seed
    engines = [engine_from_checkpoint(served), engine_from_checkpoint(served)]
    with LoopbackServer(engines[0]) as disk, LoopbackServer(engines[1]) as broadcast:
        run_ranks(sync_paths_body, 2, overrides, disk.url, broadcast.url, str(tmp_path / "weights"))
        assert disk.weight_version == broadcast.weight_version == "5"
    written = from_pretrained(tmp_path / "weights" / "v000005", dtype=torch.float32).state_dict()
    a, b = engines[0].model.state_dict(), engines[1].model.state_dict()
    assert set(a) == set(b) == set(written)
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], written[name]), name
    before = engine_from_checkpoint(served).model.state_dict()
    assert not all(torch.equal(a[name], before[name]) for name in a)  # the servers did change weights
