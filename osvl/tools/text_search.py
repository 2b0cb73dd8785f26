"""TextSearch: passages of (title, url, short query-focused summary), offline or online.

Offline: BM25 over a local JSONL corpus (``id``, ``title``, ``text``, optional ``url``) in an
SQLite FTS5 index; the summary is the few sentences of the page that carry what the query asks of it
(its words that are not the page's title), then the most query words.
Online (the paper's pipeline): Serper search -> Jina Reader page text -> an OpenAI-compatible
chat model writes a 2-4 sentence query-focused summary of each page.
"""

from __future__ import annotations

import os
import re
import sqlite3
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from osvl.jsonl import iter_jsonl
from osvl.tools.config import HttpConfig, TextSearchConfig, ToolBackendsConfig
from osvl.tools.errors import BackendError, ToolError
from osvl.tools.http_client import request, request_json
from osvl.tools.registry import ToolOutput

_WORD = re.compile(r"\w+", re.UNICODE)
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
INDEX_VERSION = 1


@dataclass
class Passage:
    title: str
    url: str
    summary: str


def render_passages(passages: list[Passage]) -> str:
    return "\n\n".join(
        f"[Passage {i}] {p.title}\nURL: {p.url}\nSummary: {p.summary}" for i, p in enumerate(passages, 1)
    )


def query_terms(query: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(query)]


# -- offline: SQLite FTS5 --------------------------------------------------------------------


def _corpus_records(corpus_path: Path):
    for number, record in iter_jsonl(corpus_path):
        if not isinstance(record, dict):
            raise ValueError(f"{corpus_path}:{number}: each line must be a JSON object")
        missing = [k for k in ("id", "title", "text") if not isinstance(record.get(k), str)]
        if missing:
            raise ValueError(f"{corpus_path}:{number}: missing or non-string field(s) {missing}")
        yield record["id"], record["title"], record["text"], str(record.get("url") or f"corpus://{record['id']}")


def _fingerprint(corpus_path: Path) -> str:
    stat = corpus_path.stat()
    return f"v{INDEX_VERSION}:{corpus_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def build_text_index(corpus_path: str | os.PathLike[str], index_path: str | os.PathLike[str]) -> Path:
    """(Re)build the FTS5 index when it is missing or older than the corpus; written atomically."""
    corpus, index = Path(corpus_path), Path(index_path)
    if not corpus.is_file():
        raise ValueError(f"text corpus {corpus} does not exist")
    fingerprint = _fingerprint(corpus)
    if index.is_file():
        with sqlite3.connect(index) as db:
            try:
                if db.execute("SELECT value FROM meta WHERE key = 'fingerprint'").fetchone() == (fingerprint,):
                    return index
            except sqlite3.DatabaseError:
                pass
    index.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=index.parent, suffix=".sqlite.tmp")
    os.close(fd)
    try:
        db = sqlite3.connect(tmp)
        db.execute(
            "CREATE VIRTUAL TABLE docs USING fts5(title, text, id UNINDEXED, url UNINDEXED, "
            "tokenize = 'porter unicode61')"
        )
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        db.executemany("INSERT INTO docs (id, title, text, url) VALUES (?, ?, ?, ?)", _corpus_records(corpus))
        db.execute("INSERT INTO meta VALUES ('fingerprint', ?)", (fingerprint,))
        db.commit()
        db.close()
        os.replace(tmp, index)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return index


def split_sentences(text: str) -> list[str]:
    """A page's sentences in order, split after ``.``, ``!`` or ``?``; blanks dropped."""
    return [s.strip() for s in _SENTENCE.split(text) if s.strip()]


def extractive_summary(
    text: str, terms: list[str], max_sentences: int = 6, max_chars: int = 1000, title: str = "", fallback: int = 3
) -> str:
    """What the query asks of the page: the sentences carrying its words that are not in the page's
    ``title`` ("Jorlo Talcor occupation" asks for the occupation; every sentence of his page names
    him), up to ``max_sentences``, those with the most such words first; when none carries one, the
    ``fallback`` sentences richest in all the query's words. In page order, cut at ``max_chars``."""
    sentences = split_sentences(text)
    if not sentences:
        return ""
    wanted = set(terms)
    topic = wanted - set(query_terms(title))
    words = [{w.lower() for w in _WORD.findall(s)} for s in sentences]
    on_topic = [i for i in range(len(sentences)) if topic & words[i]]
    if on_topic:
        keep = sorted(on_topic, key=lambda i: (-len(topic & words[i]), -len(wanted & words[i]), i))[:max_sentences]
    else:
        keep = sorted(range(len(sentences)), key=lambda i: (-len(wanted & words[i]), i))[:fallback]
    return " ".join(sentences[i] for i in sorted(keep))[:max_chars]


def offline_search(query: str, top_k: int, config: TextSearchConfig) -> list[Passage]:
    if not config.corpus_path:
        raise BackendError("offline text search needs TextSearchConfig.corpus_path")
    index_path = config.index_path or str(Path(config.corpus_path).with_suffix(".fts5.sqlite"))
    try:
        index = build_text_index(config.corpus_path, index_path)
    except ValueError as err:
        raise BackendError(str(err)) from None
    terms = query_terms(query)
    if not terms:
        raise ToolError("the query has no searchable words")
    match = " OR ".join('"' + t.replace('"', '""') + '"' for t in dict.fromkeys(terms))
    with closing(sqlite3.connect(f"file:{index}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT title, url, text FROM docs WHERE docs MATCH ? ORDER BY bm25(docs, 4.0, 1.0) LIMIT ?", (match, top_k)
        ).fetchall()
    return [Passage(title, url, extractive_summary(text, terms, title=title)) for title, url, text in rows]


# -- online: Serper -> Jina Reader -> summarizer ----------------------------------------------

SUMMARY_PROMPT = (
    "Summarize the page below in 2-4 sentences, keeping only facts relevant to the query. "
    "If the page says nothing relevant, say so in one sentence.\n\nQuery: {query}\n\nPage:\n{page}"
)


def serper_search(query: str, top_k: int, config: TextSearchConfig, http: HttpConfig) -> list[dict[str, str]]:
    payload = request_json(
        "Serper",
        "POST",
        config.serper_url,
        http,
        json_body={"q": query, "num": top_k},
        headers={"X-API-KEY": config.serper_key or "", "Content-Type": "application/json"},
    )
    organic = payload.get("organic") if isinstance(payload, dict) else None
    if not isinstance(organic, list):
        raise BackendError("Serper response has no 'organic' result list")
    results = []
    for item in organic[:top_k]:
        if isinstance(item, dict) and isinstance(item.get("link"), str):
            results.append(
                {"title": str(item.get("title", "")), "link": item["link"], "snippet": str(item.get("snippet", ""))}
            )
    return results


def jina_read(url: str, config: TextSearchConfig, http: HttpConfig) -> str:
    headers = {"Accept": "text/plain", "X-Return-Format": "markdown"}
    if config.jina_key:
        headers["Authorization"] = f"Bearer {config.jina_key}"
    return request("Jina Reader", "GET", config.jina_url + url, http, headers=headers).text


def summarize(query: str, page: str, config: TextSearchConfig, http: HttpConfig) -> str:
    headers = {"Authorization": f"Bearer {config.summarizer_key}"} if config.summarizer_key else {}
    body = {
        "model": config.summarizer_model,
        "temperature": 0.0,
        "max_tokens": 256,
        "messages": [{"role": "user", "content": SUMMARY_PROMPT.format(query=query, page=page[: config.page_chars])}],
    }
    url = (config.summarizer_url or "").rstrip("/") + "/chat/completions"
    payload = request_json("summarizer", "POST", url, http, json_body=body, headers=headers)
    try:
        content = payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise BackendError("summarizer response has no choices[0].message.content") from None
    if not isinstance(content, str) or not content.strip():
        raise BackendError("summarizer returned an empty summary")
    return content.strip()


def online_search(query: str, top_k: int, config: TextSearchConfig, http: HttpConfig) -> list[Passage]:
    hits = serper_search(query, top_k, config, http)

    def one(hit: dict[str, str]) -> Passage:
        try:
            page = jina_read(hit["link"], config, http)
        except BackendError:
            page = ""  # an unreadable page still has its search snippet
        if not page.strip():
            return Passage(hit["title"], hit["link"], f"{hit['snippet']} (page unavailable; search snippet)")
        return Passage(hit["title"], hit["link"], summarize(query, page, config, http))

    if not hits:
        return []
    with ThreadPoolExecutor(max_workers=min(len(hits), 8)) as executor:
        return list(executor.map(one, hits))


def text_search_tool(arguments: Mapping[str, Any], images: list[np.ndarray], config: ToolBackendsConfig) -> ToolOutput:
    query, top_k = arguments["query"], arguments["top_k"]
    settings = config.text_search
    if settings.backend == "online":
        passages = online_search(query, top_k, settings, config.http)
    else:
        passages = offline_search(query, top_k, settings)
    if not passages:
        raise ToolError(f"no results for {query!r}; try fewer or different keywords")
    return ToolOutput(text=render_passages(passages))
