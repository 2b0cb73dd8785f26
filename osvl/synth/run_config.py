"""Typed configuration of ``python -m osvl.synth run``: TOML file + flags -> :class:`SynthRunConfig`.

Flags are written into the raw TOML tree before validation, so a flag is checked exactly like the
file. Unknown keys and wrong types are errors naming the key (``osvl.config.loader.build``).
Secrets never appear here: the config names the environment variables that hold them.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from osvl.config.loader import build
from osvl.config.packaged import packaged_toml
from osvl.synth.pipeline import CurationConfig


@dataclass(frozen=True)
class SourceConfig:
    """Exactly one of ``world`` (a built world directory) or ``graph`` (a converted graph JSONL)."""

    world: str = ""
    graph: str = ""  # graph.jsonl from osvl.world.wikipedia.convert_wikiextractor
    images: str = ""  # directory the graph's image files are relative to
    corpus: str = ""  # corpus.jsonl; "" = beside the graph
    # sampling thresholds of a graph source (the paper's); a world carries its own in world.json
    hub_threshold: int = 10_000
    min_seed_in_degree: int = 50
    min_image_side: int = 512

    def __post_init__(self) -> None:
        if bool(self.world) == bool(self.graph):
            raise ValueError("set exactly one of world (a world directory) or graph (a graph JSONL)")
        if self.graph and not self.images:
            raise ValueError("a graph source needs images (the directory its image files are relative to)")
        if self.world and (self.images or self.corpus):
            raise ValueError("images and corpus apply to a graph source; a world directory has its own")
        defaults = SourceConfig.__dataclass_fields__
        if self.world and any(
            getattr(self, k) != defaults[k].default for k in ("hub_threshold", "min_seed_in_degree", "min_image_side")
        ):
            raise ValueError("sampling thresholds apply to a graph source; a world carries its own in world.json")
        if min(self.hub_threshold, self.min_seed_in_degree, self.min_image_side) < 1:
            raise ValueError("hub_threshold, min_seed_in_degree and min_image_side must be >= 1")


@dataclass(frozen=True)
class LLMConfig:
    """One OpenAI-compatible endpoint for every LLM stage."""

    url: str = ""  # base URL ending in /v1
    model: str = ""
    api_key_env: str = ""  # name of the environment variable holding the key ("" = no key)
    timeout_s: float = 60.0
    max_attempts: int = 3  # per request, retrying 429/5xx/timeouts before the run stops
    temperature: float = 0.0  # rewriting, uniqueness, closed-book filter (cached)
    expert_temperature: float = 0.7  # rollouts of one item differ through sampling
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, got {self.url!r}")
        if self.timeout_s <= 0 or self.max_attempts < 1 or self.max_tokens < 1:
            raise ValueError("timeout_s must be > 0 and max_attempts, max_tokens >= 1")
        if not (0.0 <= self.temperature <= 2.0 and 0.0 <= self.expert_temperature <= 2.0):
            raise ValueError("temperature and expert_temperature must lie in [0, 2]")


@dataclass(frozen=True)
class StagesConfig:
    """Which back-end each stage uses (the defaults are the offline exact ones)."""

    rewrite: Literal["graph", "llm"] = "graph"  # descriptor proposer
    uniqueness: Literal["exact", "llm"] = "exact"  # Eq. 6 evaluator
    closed_book: Literal["exact", "llm"] = "exact"  # filter stage 1 (no tools)
    # filter stage 2: exact; "tools": one real ImageSearch call, resolved exactly; "llm": the model
    # answers from one real ImageSearch result (open worlds, free-text questions)
    image_search: Literal["exact", "tools", "llm"] = "exact"
    expert: Literal["scripted", "llm"] = "scripted"
    expert_max_turns: int = 12
    send_images: bool = True  # show the question image to the LLM expert and closed-book solver

    def __post_init__(self) -> None:
        if self.rewrite == "llm" and (self.uniqueness, self.closed_book, self.image_search) != ("llm",) * 3:
            raise ValueError(
                "rewrite = 'llm' needs uniqueness, closed_book and image_search = 'llm': exact "
                "evaluators and solvers cannot read free-text descriptors"
            )
        if self.expert_max_turns < 1:
            raise ValueError(f"expert_max_turns must be >= 1, got {self.expert_max_turns}")

    @property
    def llm_stages(self) -> tuple[str, ...]:
        return tuple(
            name
            for name, uses in (
                ("rewrite", self.rewrite == "llm"),
                ("uniqueness", self.uniqueness == "llm"),
                ("closed_book", self.closed_book == "llm"),
                ("image_search", self.image_search == "llm"),
                ("expert", self.expert == "llm"),
            )
            if uses
        )


@dataclass(frozen=True)
class ToolBackendsConfig:
    """The expert's tools: exact in-process stand-ins, or the real pool (``osvl.tools``) whose
    search back-ends are offline (over the source's corpus and images) or online (URLs)."""

    mode: Literal["exact", "environment"] = "exact"
    workers: int = 2
    text_search: Literal["offline", "online"] = "offline"
    serper_url: str = "https://google.serper.dev/search"
    serper_key_env: str = "SERPER_API_KEY"
    jina_url: str = "https://r.jina.ai/"
    jina_key_env: str = ""
    summarizer_url: str = ""  # OpenAI-compatible; "" = the [llm] endpoint
    summarizer_model: str = ""  # "" = the [llm] model
    summarizer_key_env: str = ""  # "" = the [llm] key
    image_search: Literal["offline", "online"] = "offline"
    image_search_url: str = ""  # reverse-image API (osvl.tools.ImageSearchConfig.api_url)
    image_search_key_env: str = ""
    image_upload_url: str = ""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.image_search == "online" and not self.image_search_url:
            raise ValueError("image_search = 'online' needs image_search_url")


@dataclass(frozen=True)
class BudgetConfig:
    max_llm_calls: int = 0  # across all stages, per run; 0 = unlimited (a spent budget stops, resumable)
    cache_dir: str = ""  # LLM reply cache of the deterministic stages; "" = <out>/cache/llm

    def __post_init__(self) -> None:
        if self.max_llm_calls < 0:
            raise ValueError(f"max_llm_calls must be >= 0, got {self.max_llm_calls}")


@dataclass(frozen=True)
class SynthRunConfig:
    source: SourceConfig
    llm: LLMConfig = field(default_factory=LLMConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    tools: ToolBackendsConfig = field(default_factory=ToolBackendsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    curation: CurationConfig = field(default_factory=CurationConfig)

    def __post_init__(self) -> None:
        if self.stages.llm_stages and not (self.llm.url and self.llm.model):
            raise ValueError(f"stages {', '.join(self.stages.llm_stages)} use the LLM: set llm.url and llm.model")
        if self.stages.rewrite == "llm" and self.curation.text_search_filter:
            raise ValueError(
                "rewrite = 'llm' needs curation.text_search_filter = false: that stage resolves questions exactly"
            )
        uses_environment = self.tools.mode == "environment" or self.stages.image_search == "tools"
        if not uses_environment and (self.tools.text_search, self.tools.image_search) != ("offline", "offline"):
            raise ValueError(
                "online tool back-ends need the tool pool: set tools.mode = 'environment' or "
                "stages.image_search = 'tools'"
            )
        if self.tools.text_search == "online" and not (self.tools.summarizer_url or self.llm.url):
            raise ValueError("tools.text_search = 'online' needs a summarizer: tools.summarizer_url or llm.url")


SECTIONS: dict[str, type] = {
    "source": SourceConfig,
    "llm": LLMConfig,
    "stages": StagesConfig,
    "tools": ToolBackendsConfig,
    "budget": BudgetConfig,
    "curation": CurationConfig,
}
_TOOLS_OWNED = {"expert_tools": "tools.mode", "tool_workers": "tools.workers"}


def build_run_config(raw: Mapping[str, Any]) -> SynthRunConfig:
    """Validate a raw tree (parsed TOML with flags applied); errors name the key."""
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; a synth config has tables: {', '.join(SECTIONS)}")
    for key, home in _TOOLS_OWNED.items():
        if key in raw.get("curation", {}):
            raise ValueError(f"curation.{key}: set {home} instead")
    sections = {}
    for name, cls in SECTIONS.items():
        value = raw.get(name, {})
        if not isinstance(value, Mapping):
            raise ValueError(f"{name}: expected a table, got {value!r}")  # noqa: TRY004 - bad input is a ValueError
        sections[name] = build(cls, value, name)
    sections["curation"] = dataclasses.replace(
        sections["curation"], expert_tools=sections["tools"].mode, tool_workers=sections["tools"].workers
    )
    return SynthRunConfig(**sections)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A run config: a path, or the name of one shipped in ``osvl/synth/configs/`` (``wikipedia_llm``)."""
    path = packaged_toml(path, "synth/configs", "curation config")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None


def set_key(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """``raw[a][b] = value`` for ``"a.b"``, creating the table."""
    table, key = dotted.split(".")
    section = raw.setdefault(table, {})
    if not isinstance(section, dict):
        raise ValueError(f"{table}: expected a table, got {section!r}")  # noqa: TRY004 - bad input is a ValueError
    section[key] = value


def secret(env_var: str, what: str) -> str | None:
    """The value of ``env_var`` ("" = none needed); a named but unset variable is an error."""
    if not env_var:
        return None
    value = os.environ.get(env_var)
    if not value:
        raise ValueError(f"{what}: environment variable {env_var} is not set")
    return value
