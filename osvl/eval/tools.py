"""The tool back-ends an evaluation runs against, and the tool schema the checkpoint sees.

``--tools FILE.toml`` is the tool back-ends' file (:mod:`osvl.tools.config_file`: one table per
config section, secrets named by environment variable); flags override the file, a ``*_key_env``
flag names a variable, never a key; ``--world DIR`` fills in the offline corpus and image collection
when the file does not name them.

A released checkpoint was trained on the release's tool names (``--tool-profile release``): its
calls are translated to osvl's tools by :class:`EvalToolEnvironment` and results are presented
back in its own image-reference style.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from osvl.tools import profiles
from osvl.tools.config import ToolBackendsConfig
from osvl.tools.config_file import read_tools_file
from osvl.tools.environment import ToolEnvironment
from osvl.tools.profiles import ToolProfile


def check_offline_paths(config: ToolBackendsConfig) -> None:
    """An offline search back-end without its data would fail every call; say so before the run."""
    for section, path, what in (
        ("text_search", config.text_search.corpus_path, "corpus_path (corpus.jsonl)"),
        ("image_search", config.image_search.collection_path, "collection_path (images.jsonl)"),
    ):
        if getattr(config, section).backend == "offline":
            if not path:
                raise ValueError(
                    f"{section} is offline but has no {what}: pass --world DIR, set it in --tools, "
                    f"or use the online back-end"
                )
            if not Path(path).is_file():
                raise ValueError(f"{section} {what.split()[0]} not found: {path}")


class EvalToolEnvironment(profiles.ProfiledEnvironment):
    """The agentic modes' environment in ``profile``'s schema, keeping the osvl-protocol ``env`` it
    runs on for RAG, which issues osvl's own ``text_search`` calls whatever the checkpoint's profile."""

    def __init__(self, env: ToolEnvironment, profile: ToolProfile) -> None:
        super().__init__(profile, env.pool, env.cache)
        self.env = env


# command-line flag (argparse dest) -> (section, field); a *_key_env flag names a variable, never a key
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "text_search_backend": ("text_search", "backend"),
    "serper_url": ("text_search", "serper_url"),
    "serper_key_env": ("text_search", "serper_key_env"),
    "jina_url": ("text_search", "jina_url"),
    "jina_key_env": ("text_search", "jina_key_env"),
    "summarizer_url": ("text_search", "summarizer_url"),
    "summarizer_model": ("text_search", "summarizer_model"),
    "summarizer_key_env": ("text_search", "summarizer_key_env"),
    "image_search_backend": ("image_search", "backend"),
    "image_search_url": ("image_search", "api_url"),
    "image_search_key_env": ("image_search", "api_key_env"),
    "image_upload_url": ("image_search", "upload_url"),
}


def tool_sections(file: str | None, flags: Mapping[str, Any], world: str | None) -> dict[str, dict[str, Any]]:
    """The file's sections with the given flags on top and the world's offline data as defaults."""
    sections = read_tools_file(file) if file else {}
    for dest, (section, field) in FLAG_FIELDS.items():
        if flags.get(dest) is not None:
            sections.setdefault(section, {})[field] = flags[dest]
    if world:
        root = Path(world)
        sections.setdefault("text_search", {}).setdefault("corpus_path", str(root / "corpus.jsonl"))
        sections.setdefault("image_search", {}).setdefault("collection_path", str(root / "images.jsonl"))
    return sections
