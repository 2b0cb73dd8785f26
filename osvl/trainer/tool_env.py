"""The stages' tool protocol: the offline world backends in a spawned worker pool, spoken in the
recipe's tool profile, and the prompt that shows the policy that profile's schema.

``tools.profile = "release"`` is what the released OpenSearch-VL checkpoints were trained with:
their tool names and arguments in the system turn, their calls translated onto osvl's tools, and
tool images named ``img_N`` in observations. Optional injected faults let the demo and tests
exercise fatal masking and the one-sided clamp.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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


def fault_draw(seed: int, call: CallIdentity) -> float:
    """A uniform number in [0, 1) fixed by the fault seed and the call's identity (blake2b, so the
    same on every machine and Python, unlike ``hash``)."""
    key = f"{seed}/{call.group_id}/{call.sample_index}/{call.turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64


class FaultInjectingRunner:
    """Turns a seeded fraction of successful tool results into ``tool_error`` (a policy-counted error).

    Faults hit finished calls, so the worker pool, deadlines and images are exercised as usual; each
    successful call is faulted with probability ``rate`` independently, so K consecutive faults (a
    fatal cascade) happen at rate**K. Whether a call is faulted depends only on ``seed`` and the
    call's ``CallIdentity`` (set by the agent loop), never on the order calls finish in, so
    concurrent rollouts inject the same faults run after run.
    """

    def __init__(self, runner: ToolRunner, rate: float, seed: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must lie in [0, 1], got {rate}")
        self.runner, self.rate, self.seed = runner, rate, seed
        self.injected = 0

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

    def call(self, job: Job) -> ToolResult:
        call = self._identity()
        return self._maybe_fault(self.runner.call(job), call)

    async def acall(self, job: Job) -> ToolResult:
        call = self._identity()
        return self._maybe_fault(await self.runner.acall(job), call)


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
    """This rank's tools in ``tools.profile``, faults injected at ``tools.fault_rate``: the tool
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


def with_faults(env: ToolEnvironment, recipe: Recipe, rank: int) -> ToolEnvironment:
    """The same environment with ``tools.fault_rate`` injected (seeded by job seed and rank; the
    GRPO stage reseeds it per step with ``step_faults``)."""
    if recipe.tools.fault_rate == 0.0:
        return env
    runner = FaultInjectingRunner(env.pool, recipe.tools.fault_rate, seed=recipe.job.seed * 1009 + rank)
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
                                        seed=derive_seed(step, f"tool-faults/{rank}", 0, seed))
    return stepped
