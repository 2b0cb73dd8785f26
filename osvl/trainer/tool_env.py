"""The stages' tools from the recipe: the offline world backends (or the online ones, or tool
servers) in the recipe's tool profile, with the recipe's injected faults and outages.

``tools.profile = "release"`` is what the released OpenSearch-VL checkpoints were trained with:
their tool names and arguments in the system turn, their calls translated onto osvl's tools, and
tool images named ``img_N`` in observations. Optional injected faults (independent per call) and
back-end outages (correlated within a rollout; :mod:`osvl.tools.faults`) let the demo, the tests and
the fatal-mode ablation exercise fatal masking and the one-sided clamp.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from osvl.config.recipe import Recipe
from osvl.rollout.engine import derive_seed
from osvl.tools import PoolConfig, ToolEnvironment, ToolPool
from osvl.tools.config_file import online_tools_config
from osvl.tools.faults import FaultInjectingRunner, OutageModel
from osvl.tools.fleet import ToolServerFleet
from osvl.tools.limits import ToolLimits
from osvl.tools.profiles import ProfiledEnvironment, ToolProfile, profile_environment, tool_profile
from osvl.tools.sandbox import SandboxConfig, SandboxUnavailable, check_sandbox
from osvl.tools.world import world_tools_config


def recipe_sandbox(recipe: Recipe) -> SandboxConfig:
    return SandboxConfig(backend=recipe.tools.python_sandbox, fusion_url=recipe.tools.sandbox_fusion_url)


def recipe_profile(recipe: Recipe, limits: ToolLimits | None = None) -> ToolProfile:
    return tool_profile(
        recipe.tools.profile, limits, python_interpreter=recipe.tools.python_interpreter, sandbox=recipe_sandbox(recipe)
    )


def check_recipe_sandbox(recipe: Recipe) -> None:
    """Before any tool runs: a recipe offering python_interpreter gets it behind a boundary that works here."""
    if not recipe.tools.python_interpreter:
        return
    try:
        check_sandbox(recipe_sandbox(recipe))
    except SandboxUnavailable as err:
        raise ValueError(
            f"tools.python_sandbox: {err}; install what is missing, set tools.python_sandbox = "
            "'sandbox_fusion' with tools.sandbox_fusion_url, or opt out of any boundary with "
            "tools.python_sandbox = 'unsafe_no_boundary'"
        ) from None


EnvironmentFactory = Callable[[Recipe, int], AbstractContextManager[ToolEnvironment]]


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
        try:
            config = world_tools_config(t.world_dir)
        except ValueError as error:
            raise ValueError(f"tools.world_dir: {error}") from None
    else:
        raise ValueError("tools.world_dir must name a world directory for the offline backends")
    check_recipe_sandbox(recipe)  # the servers of tools.servers check their own boundary when they start
    profile = recipe_profile(recipe, config.limits)
    pool_config = PoolConfig(num_workers=t.workers, preload=profile.registry.targets())
    with ToolPool(config, pool_config) as pool:
        yield with_faults(profile_environment(profile, pool), recipe, rank)


def recipe_outages(recipe: Recipe) -> OutageModel:
    t = recipe.tools
    return OutageModel(
        rate=t.outage_rate,
        start_turns=t.outage_start_turns,
        mean_turns=t.outage_mean_turns,
        tools=tuple(t.outage_tools),
    )


def with_faults(env: ToolEnvironment, recipe: Recipe, rank: int) -> ToolEnvironment:
    """The same environment with ``tools.fault_rate`` faults and ``tools.outage_rate`` outages injected
    (seeded by job seed and rank; the GRPO stage reseeds it per step with ``step_faults``)."""
    if recipe.tools.fault_rate == 0.0 and recipe.tools.outage_rate == 0.0:
        return env
    runner = FaultInjectingRunner(
        env.pool, recipe.tools.fault_rate, seed=recipe.job.seed * 1009 + rank, outages=recipe_outages(recipe)
    )
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
    stepped.pool = FaultInjectingRunner(
        env.pool.runner, env.pool.rate, seed=derive_seed(step, f"tool-faults/{rank}", 0, seed), outages=env.pool.outages
    )
    return stepped
