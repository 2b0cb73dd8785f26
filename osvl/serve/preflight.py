"""The GRPO stage's checks before step 1, each failure a clear error naming the key or the URL.

What the recipe alone decides is :meth:`osvl.config.Recipe.check_stage`, which the stage and
``python -m osvl.train --dry-run`` both run. ``preflight`` here: every service the stage will use,
after the engines took the trainer's weights:

- each SGLang server answers ``/get_model_info`` as a generation model and, when the trainer can
  read its model directory (shared storage), serves the trainer's architecture and vocabulary (a
  Qwen3 text export is compared on the language model);
- each vLLM server answers ``/server_info`` with its engine config: logprobs taken after temperature
  (``--logprobs-mode processed_logprobs``), a tokenizer when the turns stop on strings, and, when
  the trainer can read its model directory, the trainer's architecture and vocabulary (a Qwen3 text
  export is compared on the language model);
- a probe turn (the first RL prompt, its images included) through every server: the prompt length
  the server counted equals the trainer's (else the servers' image processor settings differ and
  the image-pad runs disagree), and the sampled tokens' logprobs are the post-temperature ones
  and equal the trainer's own forward within ``rollout.max_logprob_diff`` (collective). The turn
  is compared up to its first vision placeholder (which has no pixels behind it: the agent loop
  rejects such turns) and sampled again when it starts with one;
- an LLM judge answers a probe question with a verdict;
- every tool server answers and exposes the tools of the recipe's profile.

All ranks raise together (rank 0 probes the services and broadcasts the outcome).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.packing import pack_microbatch, train_sequence
from osvl.data.vision_filler import with_grpo_filler
from osvl.model import Qwen3VLConfig, config_from_hf
from osvl.rl.scoring import GroupScorer
from osvl.rl.trajectory import FinishReason, Prompt, Step, Trajectory
from osvl.rollout import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    SGLangEngine,
)
from osvl.rollout.engine import DEFAULT_STOP
from osvl.rollout.reserved import find_unusable, reserved_vision_ids
from osvl.rollout.vllm import PROCESSED_LOGPROBS, VLLMEngine
from osvl.serve.engines import Serving, remote_engine
from osvl.step import grpo_loss_on_hidden, packed_forward
from osvl.tools import ToolEnvironment
from osvl.tools.fleet import ToolServerFleet, tool_fleet
from osvl_kernels import GRPOLossConfig

PROBE_TOKENS = 16
PROBE_SEED = 1234
# A probe turn is compared up to its first token the trainer cannot score; one that starts with such a
# token is sampled again (seed + 1, ...). An untrained policy samples vision placeholders: 5 of the
# tests' 384 ids, 1.3% a token, and SGLang ignores the seed unless it runs deterministic inference.
PROBE_ATTEMPTS = 4


class PreflightError(ValueError):
    """A service the stage needs is missing or disagrees with the trainer."""


def _arch_mismatch(server: Qwen3VLConfig, trainer: Qwen3VLConfig) -> list[str]:
    fields = {
        "vocab_size": lambda a: a.text.vocab_size,
        "hidden_size": lambda a: a.text.hidden_size,
        "num_hidden_layers": lambda a: a.text.num_hidden_layers,
        "num_attention_heads": lambda a: a.text.num_attention_heads,
        "num_key_value_heads": lambda a: a.text.num_key_value_heads,
        "num_experts": lambda a: a.text.num_experts,
        "image_token_id": lambda a: a.image_token_id,
        "vision.patch_size": lambda a: a.vision.patch_size,
        "vision.spatial_merge_size": lambda a: a.vision.spatial_merge_size,
    }
    return [
        f"{name} {get(server)} != trainer's {get(trainer)}"
        for name, get in fields.items()
        if get(server) != get(trainer)
    ]


async def _check_servers(engine: SGLangEngine, arch: Qwen3VLConfig) -> list[str]:
    lines = []
    for url in dict.fromkeys((*engine.config.urls, *engine.config.weight_urls)):
        try:
            info = await engine.get_json(url, "/get_model_info", timeout_s=30)
        except EngineError as error:
            raise PreflightError(f"rollout.sglang_urls: {error}") from None
        if not info.get("is_generation", True):
            raise PreflightError(
                f"rollout.sglang_urls: {url} serves {info.get('model_path')!r}, not a generation model"
            )
        config_file = Path(str(info.get("model_path", ""))) / "config.json"
        if config_file.is_file():
            mismatch = _served_arch_mismatch(json.loads(config_file.read_text()), arch)
            if mismatch:
                raise PreflightError(
                    f"rollout.sglang_urls: {url} serves {config_file.parent}, whose architecture "
                    f"differs from the policy's: {'; '.join(mismatch)}"
                )
            lines.append(
                f"{url}: {config_file.parent} (architecture and vocabulary match), "
                f"weight version {info.get('weight_version')!r}"
            )
        else:
            lines.append(
                f"{url}: model {info.get('model_path')!r} is not readable from the trainer, so its "
                f"architecture was not compared; the probe below still checks tokens and logprobs"
            )
    try:
        lines += [r.describe() for r in await engine.check_deterministic_inference()]
    except EngineError as error:
        raise PreflightError(f"rollout.deterministic: {error}") from None
    return lines


_TEXT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _served_arch_mismatch(raw: dict, arch: Qwen3VLConfig) -> list[str]:
    """A served ``config.json`` against the policy: a whole Qwen3-VL, or its text export."""
    if "text_config" in raw:
        return _arch_mismatch(config_from_hf(raw), arch)
    t = arch.text
    mismatch = [
        f"{name} {raw.get(name)} != trainer's {getattr(t, name)}"
        for name in _TEXT_FIELDS
        if raw.get(name) != getattr(t, name)
    ]
    if int(raw.get("num_experts") or 0) != t.num_experts:
        mismatch.append(f"num_experts {raw.get('num_experts')} != trainer's {t.num_experts}")
    return mismatch


async def _check_vllm_servers(engine: VLLMEngine, arch: Qwen3VLConfig, stop_strings: bool) -> list[str]:
    lines = []
    for url in dict.fromkeys((*engine.config.urls, *engine.config.weight_urls)):
        try:
            config = await engine.server_config(url, timeout_s=30)
        except EngineError as error:
            raise PreflightError(f"rollout.vllm_urls: {error}") from None
        model = config.get("model_config") or {}
        if model.get("logprobs_mode") != PROCESSED_LOGPROBS:
            raise PreflightError(
                f"rollout.vllm_urls: {url} returns {model.get('logprobs_mode')!r} logprobs; the "
                f"trainer's importance ratio needs them after temperature: restart it with "
                f"--logprobs-mode {PROCESSED_LOGPROBS}"
            )
        if stop_strings and model.get("skip_tokenizer_init"):
            raise PreflightError(
                f"rollout.vllm_urls: {url} runs without a tokenizer (--skip-tokenizer-init), so it "
                f"cannot stop turns on {list(DEFAULT_STOP)}: restart it without that flag"
            )
        config_file = Path(str(model.get("model", ""))) / "config.json"
        if config_file.is_file():
            mismatch = _served_arch_mismatch(json.loads(config_file.read_text()), arch)
            if mismatch:
                raise PreflightError(
                    f"rollout.vllm_urls: {url} serves {config_file.parent}, whose architecture "
                    f"differs from the policy's: {'; '.join(mismatch)}"
                )
            info = await engine.get_json(url, "/weight_info", timeout_s=30)
            lines.append(
                f"{url}: {config_file.parent} (architecture and vocabulary match), logprobs "
                f"{PROCESSED_LOGPROBS}, weight version {info.get('weight_version')!r}"
            )
        else:
            lines.append(
                f"{url}: model {model.get('model')!r} is not readable from the trainer, so its "
                f"architecture was not compared; the probe below still checks tokens and logprobs"
            )
    return lines


def _probe_request(renderer: ChatRenderer, prompt: Prompt, temperature: float) -> GenerationRequest:
    """The probe turn; like the agent loop's turns it stops at a vision placeholder (kept in the output)."""
    segment = renderer.render_prompt(prompt)
    return GenerationRequest(
        list(segment.ids),
        list(segment.images),
        SamplingParams(
            temperature=temperature,
            max_new_tokens=PROBE_TOKENS,
            stop_token_ids=reserved_vision_ids(renderer.tokenizer),
            seed=PROBE_SEED,
        ),
    )


def _scorable(result: GenerationResult, renderer: ChatRenderer) -> GenerationResult:
    """The probe's tokens before the first one the trainer cannot score: a vision placeholder, which has
    no pixels behind it (the agent loop rejects such turns), or an id outside the tokenizer's."""
    tokenizer = renderer.tokenizer
    unusable = find_unusable(result.token_ids, reserved_vision_ids(tokenizer), tokenizer.vocab_size)
    if not unusable:
        return result
    end = unusable[0].position
    versions = None if result.token_versions is None else result.token_versions[:end]
    return dataclasses.replace(
        result, token_ids=result.token_ids[:end], logprobs=result.logprobs[:end], token_versions=versions
    )


async def _probe_turn(
    where: str, engine: Engine, request: GenerationRequest, renderer: ChatRenderer
) -> GenerationResult:
    """One probe turn on ``engine``, cut before a token the trainer cannot score; sampled again (next
    seed) while nothing is left, at most ``PROBE_ATTEMPTS`` times."""
    firsts = []
    for attempt in range(PROBE_ATTEMPTS):
        sampling = dataclasses.replace(request.sampling, seed=PROBE_SEED + attempt)
        result = await engine.generate(dataclasses.replace(request, sampling=sampling))
        usable = _scorable(result, renderer)
        if usable.token_ids:
            return usable
        firsts.append(result.token_ids[0] if result.token_ids else None)
    tokenizer = renderer.tokenizer
    raise PreflightError(
        f"{where}: none of {PROBE_ATTEMPTS} probe turns has a token the trainer can score (first ids "
        f"{firsts}; vision placeholders {list(reserved_vision_ids(tokenizer))} and ids from "
        f"{tokenizer.vocab_size} on cannot be): the served policy samples them first"
    )


async def _probe(
    engine: Engine, request: GenerationRequest, renderer: ChatRenderer
) -> list[tuple[str, GenerationResult]]:
    """One probe turn per server (the router's pick when generation goes through one)."""
    if not isinstance(engine, SGLangEngine | VLLMEngine):
        return [("local engine", await _probe_turn("local engine", engine, request, renderer))]
    out = []
    key = "rollout.vllm_urls" if isinstance(engine, VLLMEngine) else "rollout.sglang_urls"
    for url in dict.fromkeys((*engine.config.urls, *engine.config.weight_urls)):
        try:
            out.append((url, await _probe_turn(url, engine.for_server(url), request, renderer)))
        except EngineError as error:
            raise PreflightError(f"{key}: the probe turn on {url} failed: {error}") from None
    return out


@torch.no_grad()
def trainer_logprobs(
    model: torch.nn.Module, renderer: ChatRenderer, prompt: Prompt, result: GenerationResult, temperature: float
) -> np.ndarray:
    """The trainer's logprobs of the probe's generated tokens, by the training step's forward and fused
    loss (collective under FSDP/TP: every rank calls it with the same probe)."""
    step = Step(token_ids=list(result.token_ids), logprobs=list(result.logprobs), text="")
    traj = Trajectory(prompt, [step], FinishReason.MAX_TURNS, group_id=0, sample_index=0)
    seq = train_sequence(traj, renderer, reward=0.0, advantage=0.0)
    batch = with_grpo_filler(pack_microbatch([seq], renderer.image_config, renderer.tokenizer.special), renderer)
    batch, hidden = packed_forward(model, batch)
    out = grpo_loss_on_hidden(model, hidden, batch, GRPOLossConfig(temperature=temperature), chunk_size=None)
    return out.logprobs[batch.loss_mask.bool()].double().cpu().numpy()


def _check_prompt_tokens(url: str, request: GenerationRequest, result: GenerationResult) -> None:
    if result.prompt_tokens and result.prompt_tokens != len(request.input_ids):
        raise PreflightError(
            f"{url}: the server counted {result.prompt_tokens} prompt tokens where the trainer rendered "
            f"{len(request.input_ids)} ({len(request.images)} image(s)): its image processor settings (min/max pixels, "
            f"patch, merge) differ from the trainer's data.min_pixels/max_pixels and the model's, so the image-pad "
            f"runs disagree"
        )


def _compare(
    url: str,
    request: GenerationRequest,
    result: GenerationResult,
    trainer_t: np.ndarray,
    trainer_raw: np.ndarray,
    temperature: float,
    tolerance: float,
) -> str:
    _check_prompt_tokens(url, request, result)
    engine = np.asarray(result.logprobs, dtype=np.float64)
    if engine.shape != trainer_t.shape:
        raise PreflightError(f"{url}: {engine.size} engine logprobs for {trainer_t.size} trainer tokens")
    post, raw = float(np.abs(engine - trainer_t).mean()), float(np.abs(engine - trainer_raw).mean())
    if temperature != 1.0 and raw < post and raw <= tolerance:  # the served weights' logprobs, before temperature
        raise PreflightError(
            f"{url}: the engine reports pre-temperature logprobs (mean |engine - trainer| {raw:.2e} at temperature 1 "
            f"vs {post:.2e} at {temperature}): the trainer's importance ratio needs log_softmax(logits / T); "
            f"unset SGLANG_RETURN_ORIGINAL_LOGPROB (SGLang), run vLLM with --logprobs-mode {PROCESSED_LOGPROBS}"
        )
    if post > tolerance:
        raise PreflightError(
            f"{url}: engine and trainer disagree on a probe turn: mean |logprob diff| {post:.3e} > "
            f"rollout.max_logprob_diff {tolerance} (weights not synced, or another model/processor)"
        )
    return f"{url}: probe of {engine.size} tokens at temperature {temperature}: mean |engine - trainer| {post:.2e}"


def _check_judges(recipe: Recipe, scorer: GroupScorer) -> list[str]:
    j = recipe.judges
    if "llm" not in (j.accuracy, j.query):
        return []
    probe = Prompt(id="preflight", question="What is two plus two?", answer="4")
    verdict = (
        scorer.judges.accuracy.judge_answer(probe, "4")
        if j.accuracy == "llm"
        else scorer.judges.query.judge_queries(probe, [])
    )
    if not verdict.scored:
        raise PreflightError(f"judges.url {j.url}: the judge ({j.model}) gave no verdict on a probe: {verdict.reason}")
    return [f"judge {j.model} at {j.url}: probe verdict {verdict.score}"]


def _check_tools(recipe: Recipe, env: ToolEnvironment) -> list[str]:
    fleet = tool_fleet(env)
    if fleet is None:
        return []
    return _check_fleet(recipe, fleet, set(env.registry.names))


def _check_fleet(recipe: Recipe, fleet: ToolServerFleet, wanted: set[str]) -> list[str]:
    lines = []
    for member in fleet.members:
        try:
            served = fleet.tool_names(member.url)
        except ValueError as error:
            raise PreflightError(f"tools.servers: {error}") from None
        missing = sorted(wanted - served)
        if missing:
            raise PreflightError(
                f"tools.servers: {member.url} does not serve {missing} (profile "
                f"{recipe.tools.profile!r}; it serves {sorted(served)})"
            )
        lines.append(f"{member.url}: serves {len(served)} tools")
    return lines


def _agree(outcome: str | list[str]) -> list[str]:
    if dist.is_initialized():
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if isinstance(outcome, str):
        raise PreflightError(outcome)
    return outcome


def preflight(
    recipe: Recipe,
    model: torch.nn.Module,
    serving: Serving,
    env: ToolEnvironment,
    scorer: GroupScorer,
    renderer: ChatRenderer,
    prompt: Prompt,
    runner: asyncio.Runner,
) -> list[str]:
    """Report lines; ``PreflightError`` on every rank when a service is missing or disagrees."""
    lead = not dist.is_initialized() or dist.get_rank() == 0
    temperature = recipe.grpo.temperature
    request = _probe_request(renderer, prompt, temperature)
    outcome: str | list = []
    if lead:
        try:
            lines = _check_tools(recipe, env) + _check_judges(recipe, scorer)
            if isinstance(serving.engine, SGLangEngine):
                lines += runner.run(_check_servers(serving.engine, model.arch))
            elif isinstance(serving.engine, VLLMEngine):
                lines += runner.run(_check_vllm_servers(serving.engine, model.arch, bool(request.sampling.stop)))
            outcome = [lines, runner.run(_probe(serving.engine, request, renderer))]
        except Exception as error:  # noqa: BLE001 - whatever stops rank 0 must reach every rank
            outcome = str(error) if isinstance(error, PreflightError) else f"pre-flight failed: {error!r}"
    lines, probes = _agree(outcome)
    for url, result in probes:
        trainer_t = trainer_logprobs(model, renderer, prompt, result, temperature)
        trainer_raw = trainer_logprobs(model, renderer, prompt, result, 1.0) if temperature != 1.0 else trainer_t
        verdict: str | list[str] = []
        if lead:
            try:
                verdict = [
                    _compare(url, request, result, trainer_t, trainer_raw, temperature, recipe.rollout.max_logprob_diff)
                ]
            except Exception as error:  # noqa: BLE001 - whatever stops rank 0 must reach every rank
                verdict = str(error) if isinstance(error, PreflightError) else f"pre-flight failed: {error!r}"
        lines += _agree(verdict)
    return lines


def check_services(
    recipe: Recipe,
    arch: Qwen3VLConfig,
    renderer: ChatRenderer,
    scorer: GroupScorer,
    tool_names: set[str],
    probe: Prompt | None,
) -> list[str]:
    """``--dry-run --preflight``: the checks that need no trainer weights, from one process (the
    logprob comparison needs the policy's forward and runs when the stage starts). ``tool_names``: the
    tools of the recipe's profile; ``probe``: the prompt of the probe turn, needed by SGLang and vLLM."""
    lines: list[str] = []
    if recipe.tools.servers:
        fleet = ToolServerFleet(recipe.tools.servers)
        try:
            lines += _check_fleet(recipe, fleet, tool_names)
        finally:
            fleet.close()
    lines += _check_judges(recipe, scorer)
    if recipe.rollout.engine in ("sglang", "vllm"):
        if probe is None:
            raise ValueError(f"rollout.engine {recipe.rollout.engine!r}: the pre-flight needs a probe prompt")
        request = _probe_request(renderer, probe, recipe.grpo.temperature)
        with asyncio.Runner() as runner:
            engine = remote_engine(recipe, arch)
            try:
                lines += runner.run(
                    _check_servers(engine, arch)
                    if isinstance(engine, SGLangEngine)
                    else _check_vllm_servers(engine, arch, bool(request.sampling.stop))
                )
                for url, result in runner.run(_probe(engine, request, renderer)):
                    _check_prompt_tokens(url, request, result)
                    lines.append(f"{url}: a probe turn's prompt length matches the trainer's rendering")
            finally:
                runner.run(engine.aclose())
    return lines


def dry_run_lines(recipe: Recipe) -> Sequence[str]:
    """What the stage will check at start that a dry run cannot (it needs the services and the weights)."""
    if recipe.job.stage != "grpo":
        return []
    r, t, j = recipe.rollout, recipe.tools, recipe.judges
    urls, update_urls = (
        (r.sglang_urls, r.sglang_update_urls) if r.engine == "sglang" else (r.vllm_urls, r.vllm_update_urls)
    )
    lines = [
        f"rollout engine {r.engine}"
        + (
            f": {', '.join(urls)}; weights by {r.weight_sync} sync to {', '.join(update_urls or urls)}"
            if r.engine != "local"
            else " (in-process, CPU form)"
        )
    ]
    lines.append(
        "tools: "
        + (
            f"servers {', '.join(t.servers)}"
            if t.servers
            else f"{t.backend} back-ends in {t.workers} local workers per rank"
        )
    )
    lines.append(
        f"judges: accuracy {j.accuracy}, query {j.query}"
        + (f" at {j.url} ({j.model})" if "llm" in (j.accuracy, j.query) else "")
    )
    lines.append(
        "at start the stage also checks: servers reachable and serving the policy's architecture, "
        "a probe turn's prompt length and post-temperature logprobs against the trainer's forward, "
        "a judge probe, the tool servers' tool lists (use --preflight to check the services now)"
    )
    return lines
