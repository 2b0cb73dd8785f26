"""A :class:`SynthRunConfig` made real: the source world and the back-end of every stage.

:func:`open_backends` is the one place where configuration turns into clients, tool pools and
solvers; ``curate`` only sees the resulting objects, so the default configuration reaches
``curate`` with nothing replaced and behaves exactly as a plain ``curate(world, out)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.synth.chat_expert import ChatExpert, ChatExpertConfig
from osvl.synth.environment import EnvironmentTools
from osvl.synth.expert import ScriptedExpert, ToolExecutor, WorldTools
from osvl.synth.llm import LLMDescriptorProposer, LLMUniquenessEvaluator
from osvl.synth.llm_access import LLMUsage, MeteredChat
from osvl.synth.pipeline import question_image
from osvl.synth.run_config import SynthRunConfig, secret
from osvl.synth.tool_solvers import (
    ChatClosedBookSolver,
    ChatImageSearchSolver,
    ToolImageSearchSolver,
)
from osvl.tools import (
    ImageSearchConfig,
    PoolConfig,
    TextSearchConfig,
    ToolBackendsConfig,
    tool_schemas,
)
from osvl.tools.world import world_environment, world_tools_config
from osvl.world.build import SamplingDefaults, World, graph_world, load_world
from osvl.world.graph import Graph


def open_world(config: SynthRunConfig, out: Path) -> World:
    """The configured source; a graph source's image collection is derived into ``out``."""
    source = config.source
    if source.world:
        return load_world(source.world)
    return graph_world(
        source.graph,
        source.images,
        out / "source_images.jsonl",
        source.corpus or None,
        SamplingDefaults(source.hub_threshold, source.min_seed_in_degree, source.min_image_side),
    )


def tools_config(config: SynthRunConfig, world: World, out: Path) -> ToolBackendsConfig:
    """The offline back-ends over the world, with the search tools switched online as configured."""
    tools, llm = config.tools, config.llm
    offline = world_tools_config(world, out / "cache" / "corpus.fts5.sqlite")
    text_search, image_search = offline.text_search, offline.image_search
    if tools.text_search == "online":
        text_search = TextSearchConfig(
            backend="online",
            serper_url=tools.serper_url,
            serper_key=secret(tools.serper_key_env, "tools.serper_key_env"),
            jina_url=tools.jina_url,
            jina_key=secret(tools.jina_key_env, "tools.jina_key_env"),
            summarizer_url=tools.summarizer_url or llm.url,
            summarizer_model=tools.summarizer_model or llm.model,
            summarizer_key=secret(tools.summarizer_key_env or llm.api_key_env, "tools.summarizer_key_env"),
        )
    if tools.image_search == "online":
        image_search = ImageSearchConfig(
            backend="online",
            api_url=tools.image_search_url,
            api_key=secret(tools.image_search_key_env, "tools.image_search_key_env"),
            upload_url=tools.image_upload_url or None,
        )
    return dataclasses.replace(offline, text_search=text_search, image_search=image_search)


def page_context(graph: Graph):
    """What the LLM proposer reads about an entity: its graph facts (memory stays proportional to
    the graph; page text is not loaded)."""

    def context(page_id: str) -> str:
        page = graph[page_id]
        facts = [f"{k}: {v}" for k, v in sorted(page.infobox.items())]
        links = [
            f"{link.relation}: {graph[t].title}" for link in page.links if (t := graph.resolve(link.target)) is not None
        ]
        return "; ".join([f"{page.title} ({page.kind or 'entity'})", *facts, *links[:20]])

    return context


@dataclass
class Backends:
    """What ``curate`` receives (keyword arguments) plus the LLM usage it reports."""

    world: World
    usage: LLMUsage | None = None
    curate_kwargs: dict[str, Any] = field(default_factory=dict)


@contextmanager
def open_backends(config: SynthRunConfig, out: str | Path) -> Iterator[Backends]:
    """Clients, tool pool and solvers for the configured stages; closed when the block ends."""
    out = Path(out)
    world = open_world(config, out)
    stages = config.stages
    with ExitStack() as stack:
        backends = Backends(world)
        kwargs = backends.curate_kwargs
        pool: ToolExecutor | None = None
        if config.tools.mode == "environment" or stages.image_search == "tools":
            pool = EnvironmentTools(
                stack.enter_context(
                    world_environment(
                        world, PoolConfig(num_workers=config.tools.workers), config=tools_config(config, world, out)
                    )
                )
            )
        tools = pool if config.tools.mode == "environment" else WorldTools(world)
        if stages.llm_stages:
            llm = config.llm
            judge = ChatJudgeConfig(
                base_url=llm.url,
                model=llm.model,
                api_key=secret(llm.api_key_env, "llm.api_key_env"),
                timeout_s=llm.timeout_s,
                max_attempts=llm.max_attempts,
                temperature=llm.temperature,
                max_tokens=llm.max_tokens,
            )
            client = stack.enter_context(ChatCompletionsClient(judge))
            usage = backends.usage = LLMUsage(config.budget.max_llm_calls or None)
            cache = Path(config.budget.cache_dir) if config.budget.cache_dir else out / "cache" / "llm"

            def metered(stage: str) -> MeteredChat:
                return MeteredChat(client, stage, usage, cache / f"{stage}.jsonl")

            if stages.rewrite == "llm":
                proposer = LLMDescriptorProposer(metered("rewrite"), world.graph, page_context(world.graph))
                kwargs["proposer"] = lambda rng: proposer
            if stages.uniqueness == "llm":
                kwargs["evaluator"] = LLMUniquenessEvaluator(metered("uniqueness"), world.graph)
            if stages.closed_book == "llm":
                image = (lambda item: question_image(world, out, item)) if stages.send_images else None
                kwargs["closed_book"] = ChatClosedBookSolver(metered("closed_book"), image)
            if stages.image_search == "llm":
                kwargs["image_search"] = ChatImageSearchSolver(
                    metered("image_search"), tools, lambda item: question_image(world, out, item)
                )
            if stages.expert == "llm":
                sampling = stack.enter_context(
                    ChatCompletionsClient(dataclasses.replace(judge, temperature=llm.expert_temperature))
                )
                kwargs["expert"] = ChatExpert(
                    MeteredChat(sampling, "expert", usage),
                    tools,
                    tool_schemas(),
                    ChatExpertConfig(max_turns=stages.expert_max_turns, send_images=stages.send_images),
                )
            kwargs["llm_usage"] = usage
        if stages.image_search == "tools":
            kwargs["image_search"] = ToolImageSearchSolver(
                world.graph, pool, lambda item: question_image(world, out, item), config.curation.fame_in_degree
            )
        if config.tools.mode == "environment" and "expert" not in kwargs:  # the scripted expert on the running pool
            kwargs["expert"] = ScriptedExpert(world.graph, tools, config.curation.expert)
        yield backends
