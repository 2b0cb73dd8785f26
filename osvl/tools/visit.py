"""``visit``: fetch one web page as readable text (the release's page-reading tool).

Online the page goes through Jina Reader (``TextSearchConfig.jina_url``/``jina_key``, the same
reader TextSearch uses); offline it is looked up by URL in the local corpus
(``TextSearchConfig.corpus_path``, through the FTS index TextSearch already builds). A long page
is cut to ``page_chars``; with a ``goal`` the paragraphs sharing the most words with it are kept
(in page order) instead of the first ones.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from osvl.tools.config import ToolBackendsConfig
from osvl.tools.errors import BackendError, ToolError
from osvl.tools.limits import ToolLimits
from osvl.tools.registry import ToolOutput, ToolSpec
from osvl.tools.text_search import build_text_index, jina_read, query_terms


def focus_page(text: str, goal: str, max_chars: int) -> str:
    """The page cut to ``max_chars``: goal-relevant paragraphs first in rank, then in page order."""
    if len(text) <= max_chars:
        return text
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    wanted = set(query_terms(goal))
    if not wanted:
        return text[:max_chars]
    scores = [len(wanted & set(query_terms(p))) for p in paragraphs]
    keep: list[int] = []
    used = 0
    for index in sorted(range(len(paragraphs)), key=lambda i: (-scores[i], i)):
        if used + len(paragraphs[index]) + 2 > max_chars:
            continue
        keep.append(index)
        used += len(paragraphs[index]) + 2
    return "\n\n".join(paragraphs[i] for i in sorted(keep)) or text[:max_chars]


def offline_page(url: str, corpus_path: str, index_path: str | None) -> tuple[str, str]:
    """(title, text) of the corpus article whose ``url`` (or ``id``) is ``url``."""
    index = build_text_index(corpus_path, index_path or str(Path(corpus_path).with_suffix(".fts5.sqlite")))
    with closing(sqlite3.connect(f"file:{index}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT title, text FROM docs WHERE url = ? OR id = ? LIMIT 1", (url, url)).fetchone()
    if row is None:
        raise ToolError(f"no page at {url!r}; visit URLs that search results returned")
    return row


def visit_tool(arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig) -> ToolOutput:
    url, goal = arguments["url"].strip(), arguments.get("goal", "")
    settings = config.text_search
    if settings.backend == "online":
        if not url.startswith(("http://", "https://")):
            raise ToolError(f"url must start with http:// or https://, got {url!r}")
        title, text = url, jina_read(url, settings, config.http)
    else:
        if not settings.corpus_path:
            raise BackendError("offline visit needs TextSearchConfig.corpus_path")
        try:
            title, text = offline_page(url, settings.corpus_path, settings.index_path)
        except ValueError as err:  # a missing or malformed corpus is ours to fix
            raise BackendError(str(err)) from None
    if not text.strip():
        raise ToolError(f"the page at {url!r} has no readable text")
    return ToolOutput(text=f"Title: {title}\nURL: {url}\n\n{focus_page(text, goal, settings.page_chars)}")


def visit_spec(limits: ToolLimits | None = None) -> ToolSpec:
    limits = limits or ToolLimits()
    return ToolSpec(
        name="visit",
        description="Open a web page (a URL from search results) and read its text. With a goal, the "
        "parts of a long page that matter for it are kept.",
        parameters={
            "type": "object",
            "properties": {
                "url": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": limits.max_text_chars,
                    "description": "The page URL.",
                },
                "goal": {
                    "type": "string",
                    "maxLength": limits.max_text_chars,
                    "default": "",
                    "description": "What you are looking for on the page.",
                },
            },
            "required": ["url"],
        },
        target="osvl.tools.visit:visit_tool",
        deadline_s=60.0,
        cacheable=True,
    )
