"""The GRPO stage's pre-flight against real loopback services: it passes when engine, judge and tool
servers agree with the trainer, and names the URL and the mismatch when one does not (pre-temperature
logprobs, other image settings, another architecture, other weights, a judge outage, missing tools),
and the dry run refuses exactly what the stage refuses."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from contextlib import contextmanager

import pytest
import torch

from osvl.config import Recipe, load_recipe
from osvl.config.recipe import JudgesConfig, RolloutConfig
from osvl.data.chat import ChatRenderer
from osvl.data.formats.processor import PREPROCESSOR_FILE
from osvl.model import save_pretrained
from osvl.rollout import GenerationRequest, GenerationResult, LocalEngine, SGLangConfig, SGLangEngine
from osvl.rollout.weight_sync import InProcessSync
from osvl.serve.engines import Serving
from osvl.serve.loopback_engine import LoopbackServer
from osvl.serve.loopback_judge import LoopbackJudgeServer
from osvl.serve.preflight import PROBE_ATTEMPTS, PreflightError, preflight
from osvl.tools import ToolEnvironment, ToolRegistry
from osvl.train import dry_run
from osvl.trainer.grpo_data import stage_scorer
from tests.rollout.helpers import IMAGE_CONFIG, prompts, tiny_model, tokenizer
from tests.tools.fault_tools import fault_specs

RENDERER = ChatRenderer(tokenizer(), IMAGE_CONFIG)


def _recipe(**judges) -> Recipe:
    return Recipe(rollout=RolloutConfig(max_logprob_diff=1e-4), judges=JudgesConfig(**judges))


@contextmanager
def _served(tmp_path, *, model_seed=0, image_config=IMAGE_CONFIG, logprobs="post_temperature", moe=False):
    """A loopback SGLang server over a checkpoint of ``tiny_model(model_seed)`` written to disk."""
    directory = tmp_path / f"served-{model_seed}-{moe}"
    save_pretrained(tiny_model(model_seed, moe=moe), directory, dtype=torch.float32)
    (directory / PREPROCESSOR_FILE).write_text(json.dumps(image_config.to_preprocessor_config()))
    engine = LocalEngine(tiny_model(model_seed, moe=moe), tokenizer(), image_config)
    with LoopbackServer(engine, model_path=str(directory), logprobs=logprobs) as server, asyncio.Runner() as runner:
        client = SGLangEngine(SGLangConfig((server.url,), timeout_s=60))
        yield server, Serving(client, InProcessSync(engine)), runner
        runner.run(client.aclose())


def _run(recipe, serving, runner, env=None, model=None):
    env = env or ToolEnvironment(ToolRegistry(fault_specs()), pool=None)
    scorer = stage_scorer(recipe)
    try:
        return preflight(recipe, model or tiny_model(0), serving, env, scorer, RENDERER, prompts(1)[0], runner)
    finally:
        scorer.close()


def test_agreeing_services_pass_with_a_report(tmp_path):
    with _served(tmp_path) as (server, serving, runner), LoopbackJudgeServer() as judge:
        lines = _run(_recipe(accuracy="llm", query="llm", url=judge.base_url, model="loopback"), serving, runner)
    text = "\n".join(lines)
    assert "architecture and vocabulary match" in text and f"{server.url}: probe of" in text
    assert "probe verdict 1.0" in text


def test_pre_temperature_logprobs_are_named(tmp_path):
    with _served(tmp_path, logprobs="raw") as (server, serving, runner):
        with pytest.raises(PreflightError, match=f"{server.url}: the engine reports pre-temperature logprobs"):
            _run(_recipe(), serving, runner)


def test_other_image_settings_are_caught_by_the_pad_count(tmp_path):
    other = dataclasses.replace(IMAGE_CONFIG, max_pixels=16)  # the server shrinks images further
    with _served(tmp_path, image_config=other) as (server, serving, runner):
        with pytest.raises(PreflightError, match=f"{server.url}: the server counted .* image-pad"):
            _run(_recipe(), serving, runner)


def test_another_architecture_or_other_weights_are_named(tmp_path):
    with _served(tmp_path, moe=True) as (server, serving, runner):
        with pytest.raises(PreflightError, match=f"{server.url} serves .*num_experts 4 != trainer's 0"):
            _run(_recipe(), serving, runner)
    with _served(tmp_path, model_seed=3) as (server, serving, runner):  # same architecture, not synced
        with pytest.raises(PreflightError, match=f"{server.url}: engine and trainer disagree"):
            _run(_recipe(), serving, runner)


def test_a_judge_that_cannot_answer_stops_the_stage(tmp_path):
    with _served(tmp_path) as (_, serving, runner), LoopbackJudgeServer() as judge:
        judge.outage = 503
        recipe = _recipe(accuracy="llm", url=judge.base_url, model="loopback", max_attempts=1, overload_wait_s=0.5)
        with pytest.raises(PreflightError, match=f"judges.url {judge.base_url}.*overloaded_http_503"):
            _run(recipe, serving, runner)


def test_an_unreachable_engine_is_named(tmp_path):
    with asyncio.Runner() as runner:
        client = SGLangEngine(SGLangConfig(("http://127.0.0.1:9",), timeout_s=5))
        serving = Serving(client, InProcessSync(LocalEngine(tiny_model(0), tokenizer(), IMAGE_CONFIG)))
        with pytest.raises(PreflightError, match="rollout.sglang_urls: .*127.0.0.1:9"):
            _run(_recipe(), serving, runner)


class SamplesImagePads:
    """A served policy that samples ``<|image_pad|>``, as a remote engine may (only the local engine
    masks it out): the local engine's turn cut after an image pad put at ``at[i]`` on the i-th call, the
    last one kept for later calls, as a server stopping at it answers."""

    def __init__(self, at: list[int]) -> None:
        self.engine = LocalEngine(tiny_model(0), tokenizer(), IMAGE_CONFIG)
        self.at, self.calls = at, 0

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.engine.generate(request)
        at = self.at[min(self.calls, len(self.at) - 1)]
        self.calls += 1
        assert len(result.token_ids) > at, result
        ids = [*result.token_ids[:at], tokenizer().special.image_pad]
        return dataclasses.replace(result, token_ids=ids, logprobs=result.logprobs[: at + 1])


@pytest.mark.parametrize("at", [[5], [0, 3]], ids=["mid-turn", "first-token-then-resampled"])
def test_a_probe_that_samples_an_image_pad_is_compared_before_it(at):
    """A probe turn with an image pad has no pixels for the trainer's forward: it is compared up to the
    pad, and one that starts with a pad is sampled again."""
    engine = SamplesImagePads(at)
    with asyncio.Runner() as runner:
        lines = _run(_recipe(), Serving(engine, InProcessSync(engine.engine)), runner)
    assert f"local engine: probe of {at[-1]} tokens" in "\n".join(lines), lines
    assert engine.calls == len(at)


def test_a_probe_that_always_starts_with_an_image_pad_is_named():
    engine = SamplesImagePads([0])
    with asyncio.Runner() as runner, pytest.raises(PreflightError) as refused:
        _run(_recipe(), Serving(engine, InProcessSync(engine.engine)), runner)
    assert engine.calls == PROBE_ATTEMPTS
    assert str(refused.value).startswith(
        f"local engine: none of {PROBE_ATTEMPTS} probe turns has a token the trainer can score "
        f"(first ids {[tokenizer().special.image_pad] * PROBE_ATTEMPTS}"
    )


def test_the_dry_run_refuses_what_the_stage_refuses():
    recipe = load_recipe("grpo_8b", ["tools.servers=[]", "tools.config_file="])
    with pytest.raises(ValueError) as stage:
        recipe.check_stage(64)
    with pytest.raises(ValueError) as dry:
        dry_run(recipe)
    assert str(stage.value) == str(dry.value) and "tools.config_file" in str(dry.value)
    lines = "\n".join(dry_run(load_recipe("grpo_8b")))
    assert "serving: 1 SGLang server(s) x TP 4" in lines and "weight sync:" in lines and "fits:" in lines
