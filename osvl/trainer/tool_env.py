"""The stages' tool protocol: the offline world backends in a spawned worker pool, spoken in the
recipe's tool profile, and the prompt that shows the policy that profile's schema.

``tools.profile = "release"`` is what the released OpenSearch-VL checkpoints were trained with:
their tool names and arguments in the system turn, their calls translated onto osvl's tools, and
tool images named ``img_N`` in observations. Optional injected faults (independent per call) and
back-end outages (correlated within a rollout) let the demo, the tests and the fatal-mode ablation
exercise fatal masking and the one-sided clamp.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osvl.config.recipe import Recipe
from osvl.data.chat import ChatRenderer
from osvl.data.formats import checkpoint_image_config
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import Tokenizer
from osvl.model import Qwen3VLConfig
from osvl.rl.trajectory import ToolResult, ToolStatus
from osvl.rollout.agent import CallIdentity, current_call
from osvl.rollout.engine import derive_seed
from osvl.tools import (
    ImageSearchConfig,
    Job,
    PoolConfig,
    TextSearchConfig,
    ToolEnvironment,
    ToolPool,
    ToolsConfig,
)
from osvl.tools.environment import ToolRunner
from osvl.tools.fleet import ToolServerFleet
from osvl.tools.limits import ToolLimits
from osvl.tools.sandbox import SandboxConfig, SandboxUnavailable, check_sandbox
from osvl.tools.profiles import (
    ProfiledEnvironment,
    ToolProfile,
    profile_environment,
    tool_profile,
)
from osvl.trainer.policy import image_config
from osvl.trainer.sft_data import read_system_prompt

INJECTED = "injected fault"
OUTAGE_KINDS = ("http_503", "http_429", "timeout")


def _uniform(key: str) -> float:
    """A uniform number in [0, 1) fixed by ``key`` (blake2b, so the same on every machine and Python,
    unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


def fault_draw(seed: int, call: CallIdentity) -> float:
    """The uniform draw that decides whether one call is faulted: fixed by the fault seed and the call's identity."""
    return _uniform(f"{seed}/{call.group_id}/{call.sample_index}/{call.turn}")


@dataclass(frozen=True)
class OutageModel:
    """Correlated back-end outages: how a real API outage reaches the agent.

    Per rollout, with probability ``rate`` the back-end serving ``tools`` goes down at a turn drawn
    uniformly from ``[0, start_turns)`` and stays down for ``mean_turns`` turns on average (a
    geometric duration, the memoryless choice; ``0`` = until the rollout ends). Every call to those
    tools in that window answers as the online back-ends do when their provider fails: HTTP 503,
    HTTP 429 or no answer before the deadline, each typed ``infra_error`` (``osvl.tools.http_client``
    types them the same way). A down back-end does no work, so the call is not run. Unlike
    independent faults (a cascade of K at ``rate**K``), an outage that begins after a good first
    call makes the K-consecutive rule fire on a rollout whose prefix was sound.

    Every draw is a function of the seed and the rollout's (group, sample) or the call's identity,
    so runs and resumes meet the same outages whatever order calls finish in.
    """

    rate: float = 0.0
    start_turns: int = 4
    mean_turns: float = 0.0
    tools: tuple[str, ...] = ("text_search", "image_search")

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"outage rate must lie in [0, 1], got {self.rate}")
        if self.start_turns < 1:
            raise ValueError(f"outage start_turns must be >= 1, got {self.start_turns}")
        if self.mean_turns != 0.0 and not self.mean_turns >= 1.0:
            raise ValueError(f"outage mean_turns must be 0 (to the rollout's end) or >= 1, got {self.mean_turns}")
        if self.rate > 0.0 and not self.tools:
            raise ValueError("an outage rate > 0 needs the tools whose back-end goes down")

    def window(self, seed: int, group_id: int, sample_index: int) -> tuple[int, float] | None:
        """``(first turn, end turn)`` of this rollout's outage (end exclusive, ``inf`` = to its end), or None."""
        key = f"{seed}/outage/{group_id}/{sample_index}"
        if _uniform(f"{key}/hit") >= self.rate:
            return None
        start = int(_uniform(f"{key}/start") * self.start_turns)
        if self.mean_turns == 0.0:
            return start, math.inf
        stop = 1.0 / self.mean_turns  # a geometric duration >= 1 with this mean, by inverting its CDF
        u = _uniform(f"{key}/duration")
        duration = 1 if stop >= 1.0 else 1 + int(math.log1p(-u) / math.log1p(-stop))
        return start, start + duration

    def hits(self, seed: int, call: CallIdentity, tool: str) -> bool:
        if self.rate == 0.0 or tool not in self.tools:
            return False
        window = self.window(seed, call.group_id, call.sample_index)
        return window is not None and window[0] <= call.turn < window[1]

    @staticmethod
    def result(seed: int, call: CallIdentity, tool: str, deadline_s: float) -> ToolResult:
        """What the agent sees from a down back-end: one of 503, 429 or a timeout, drawn per call."""
        kind = OUTAGE_KINDS[int(_uniform(f"{seed}/outage-kind/{call.group_id}/{call.sample_index}/{call.turn}") * 3)]
        error = {"http_503": f"{tool} back-end failed with HTTP 503 (Service Unavailable)",
                 "http_429": f"{tool} back-end rate-limited the call (HTTP 429 Too Many Requests)",
                 "timeout": f"{tool} back-end did not answer within {deadline_s:g}s"}[kind]
        return ToolResult(status=ToolStatus.INFRA_ERROR, tool=tool, error=error)


class FaultInjectingRunner:
    """Injects seeded tool failures: independent faults and correlated back-end outages.

    Independent faults turn a fraction ``rate`` of successful results into ``tool_error`` (a
    policy-counted error); they hit finished calls, so the worker pool, deadlines and images are
    exercised as usual, and K consecutive faults (a fatal cascade) happen at rate**K. Outages
    (``outages``, see :class:`OutageModel`) answer every call to a down back-end with an
    ``infra_error`` for a stretch of turns of one rollout. Every decision depends only on ``seed`` and
    the call's ``CallIdentity`` (set by the agent loop), never on the order calls finish in, so
    concurrent rollouts meet the same failures run after run.
    """

    def __init__(self, runner: ToolRunner, rate: float, seed: int, outages: OutageModel = OutageModel()) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must lie in [0, 1], got {rate}")
        self.runner, self.rate, self.seed, self.outages = runner, rate, seed, outages
        self.injected = 0
        self.outage_errors = 0

    @staticmethod
    def _identity() -> CallIdentity:
        call = current_call.get()
        if call is None:
            raise ValueError("fault injection needs the identity of the tool call: run calls through the agent loop "
                             "(osvl.rollout.run_trajectory) or set osvl.rollout.agent.current_call")
        return call

    def _maybe_fault(self, result: ToolResult, call: CallIdentity) -> ToolResult:
        if not result.ok or fault_draw(self.seed, call) >= self.rate:
            return result
        self.injected += 1
        return ToolResult(status=ToolStatus.TOOL_ERROR, tool=result.tool, error=INJECTED, elapsed_s=result.elapsed_s)

    def _outage(self, job: Job, call: CallIdentity) -> ToolResult | None:
        if not self.outages.hits(self.seed, call, job.tool):
            return None
        self.outage_errors += 1
        return self.outages.result(self.seed, call, job.tool, job.deadline_s)

    def call(self, job: Job) -> ToolResult:
        call = self._identity()
        down = self._outage(job, call)
        return down if down is not None else self._maybe_fault(self.runner.call(job), call)

    async def acall(self, job: Job) -> ToolResult:
        call = self._identity()
        down = self._outage(job, call)
        return down if down is not None else self._maybe_fault(await self.runner.acall(job), call)


def world_tools_config(world_dir: str | Path) -> ToolsConfig:
    """Offline TextSearch (FTS5) over ``corpus.jsonl`` and ImageSearch over ``images.jsonl``."""
    root = Path(world_dir)
    corpus, collection = root / "corpus.jsonl", root / "images.jsonl"
    for path in (corpus, collection):
        if not path.is_file():
            raise ValueError(f"tools.world_dir: {root} has no {path.name}; build it with "
                             f"`python -m osvl.world build --out {root}`")
    return ToolsConfig(text_search=TextSearchConfig(corpus_path=str(corpus)),
                       image_search=ImageSearchConfig(collection_path=str(collection)))


def recipe_sandbox(recipe: Recipe) -> SandboxConfig:
    return SandboxConfig(backend=recipe.tools.python_sandbox, fusion_url=recipe.tools.sandbox_fusion_url)


def recipe_profile(recipe: Recipe, limits: ToolLimits | None = None) -> ToolProfile:
    return tool_profile(recipe.tools.profile, limits, python_interpreter=recipe.tools.python_interpreter,
                        sandbox=recipe_sandbox(recipe))


def check_recipe_sandbox(recipe: Recipe) -> None:
    """Before any tool runs: a recipe offering python_interpreter gets it behind a boundary that works here."""
    if not recipe.tools.python_interpreter:
        return
    try:
        check_sandbox(recipe_sandbox(recipe))
    except SandboxUnavailable as err:
        raise ValueError(f"tools.python_sandbox: {err}; install what is missing, set tools.python_sandbox = "
                         "'sandbox_fusion' with tools.sandbox_fusion_url, or opt out of any boundary with "
                         "tools.python_sandbox = 'unsafe_no_boundary'") from None


def stage_image_config(recipe: Recipe, arch: Qwen3VLConfig) -> ImageConfig:
    """A checkpoint directory's ``preprocessor_config.json`` when the recipe names no tokenizer of
    its own (the directory is the whole released model), else the recipe's pixel budget."""
    fallback = image_config(arch, recipe)
    if not recipe.model.pretrained or recipe.data.tokenizer:
        return fallback
    shipped = checkpoint_image_config(recipe.model.pretrained)
    if shipped is None:
        return fallback
    v = arch.vision
    expected = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
    found = (shipped.patch_size, shipped.temporal_patch_size, shipped.merge_size)
    if found != expected:
        raise ValueError(f"model.pretrained: preprocessor_config.json patches images as (patch, temporal, merge) "
                         f"= {found} but the vision tower in config.json expects {expected}")
    return shipped


def stage_prompt(recipe: Recipe) -> tuple[str, list[dict[str, Any]]]:
    """``(system prompt, tool schemas shown)`` of both stages: ``data.system_prompt`` and, for the
    release profile, the release tool schema. The paper profile shows no schema, as osvl's own SFT
    data has none. The exported chat template carries the same pair."""
    tools = recipe_profile(recipe).tool_schemas() if recipe.tools.profile == "release" else []
    return read_system_prompt(recipe.data.system_prompt), tools


def stage_renderer(recipe: Recipe, tokenizer: Tokenizer, arch: Qwen3VLConfig) -> ChatRenderer:
    """The prompt both stages render (:func:`stage_prompt`)."""
    system_prompt, tools = stage_prompt(recipe)
    return ChatRenderer(tokenizer, stage_image_config(recipe, arch), tools, system_prompt)


EnvironmentFactory = Callable[[Recipe, int], AbstractContextManager[ToolEnvironment]]


def online_tools_config(path: str) -> ToolsConfig:
    """The online back-ends of ``tools.config_file`` (the TOML ``osvl.eval --tools`` reads; keys
    come from the environment variables its ``*_key_env`` fields name)."""
    from osvl.eval.tools import read_tools_file, resolve_sections

    if not path:
        raise ValueError("tools.backend = 'online' needs tools.config_file (a TOML with the online back-ends, "
                         "keys named by *_key_env fields) or tools.servers (tool servers that hold them)")
    try:
        return resolve_sections(read_tools_file(path))
    except ValueError as error:
        raise ValueError(f"tools.config_file: {error}") from None


@contextmanager
def stage_environment(recipe: Recipe, rank: int) -> Iterator[ToolEnvironment]:
    """This rank's tools in ``tools.profile``, faults and outages injected (``with_faults``): the tool
    servers of ``tools.servers`` when set, else a local worker pool over the online back-ends
    (``tools.backend = "online"``) or the recipe's offline world."""
    t = recipe.tools
    if t.servers:
        fleet = ToolServerFleet(t.servers, max_concurrency=recipe.rollout.max_in_flight)
        try:
            yield with_faults(profile_environment(recipe_profile(recipe), fleet), recipe, rank)
        finally:
            fleet.close()
        return
    if t.backend == "online":
        config = online_tools_config(t.config_file)
    elif t.world_dir:
        config = world_tools_config(t.world_dir)
    else:
        raise ValueError("tools.world_dir must name a world directory for the offline backends")
    check_recipe_sandbox(recipe)  # the servers of tools.servers check their own boundary when they start
    profile = recipe_profile(recipe, config.limits)
    pool_config = PoolConfig(num_workers=t.workers, preload=profile.registry.targets())
    with ToolPool(config, pool_config) as pool:
        yield with_faults(profile_environment(profile, pool), recipe, rank)


def recipe_outages(recipe: Recipe) -> OutageModel:
    t = recipe.tools
    return OutageModel(rate=t.outage_rate, start_turns=t.outage_start_turns, mean_turns=t.outage_mean_turns,
                       tools=tuple(t.outage_tools))


def with_faults(env: ToolEnvironment, recipe: Recipe, rank: int) -> ToolEnvironment:
    """The same environment with ``tools.fault_rate`` faults and ``tools.outage_rate`` outages injected
    (seeded by job seed and rank; the GRPO stage reseeds it per step with ``step_faults``)."""
    if recipe.tools.fault_rate == 0.0 and recipe.tools.outage_rate == 0.0:
        return env
    runner = FaultInjectingRunner(env.pool, recipe.tools.fault_rate, seed=recipe.job.seed * 1009 + rank,
                                  outages=recipe_outages(recipe))
    if isinstance(env, ProfiledEnvironment):
        return ProfiledEnvironment(env.profile, runner, env.cache)
    return ToolEnvironment(env.registry, runner, env.cache)


def step_faults(env: ToolEnvironment, seed: int, step: int, rank: int) -> ToolEnvironment:
    """Faults seeded by (job seed, step, rank): with each call's identity (group, sample, turn) that
    fixes every fault decision, so a resumed run injects the same faults without checkpointing the
    injector, and concurrent rollouts inject them whatever order the calls finish in. The GRPO
    stage passes the prompt-stream batch a group was drawn in as ``step``."""
    if not isinstance(env.pool, FaultInjectingRunner):
        return env
    stepped = copy.copy(env)  # keeps the environment's class (a tool profile translates calls)
    stepped.pool = FaultInjectingRunner(env.pool.runner, env.pool.rate,
                                        seed=derive_seed(step, f"tool-faults/{rank}", 0, seed), outages=env.pool.outages)
    return stepped
