import json

import httpx
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import TextSearchConfig, ToolBackendsConfig, http_client
from osvl.tools.visit import focus_page, visit_spec, visit_tool
from osvl.tools.worker import run_job

PAGE = "Intro paragraph about cities.\n\nThe Kessock Bridge opened in 1982 near Inverness.\n\nUnrelated trivia."


@pytest.fixture()
def offline(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [
        {"id": "p1", "title": "Kessock Bridge", "text": PAGE, "url": "world://p1"},
        {"id": "p2", "title": "Empty", "text": " ", "url": "world://p2"},
    ]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ToolBackendsConfig(text_search=TextSearchConfig(corpus_path=str(corpus)))


def test_offline_visit_reads_the_corpus_page_by_url_or_id(offline):
    status, text, _, error = run_job(visit_spec().target, {"url": "world://p1", "goal": ""}, [], offline)
    assert status is ToolStatus.OK, error
    assert text.startswith("Title: Kessock Bridge\nURL: world://p1") and "opened in 1982" in text
    assert "opened in 1982" in visit_tool({"url": "p1"}, [], offline).text


def test_offline_visit_errors_are_typed(offline):
    status, _, _, error = run_job(visit_spec().target, {"url": "world://nope"}, [], offline)
    assert status is ToolStatus.TOOL_ERROR and "no page" in error
    status, _, _, error = run_job(visit_spec().target, {"url": "world://p2"}, [], offline)
    assert status is ToolStatus.TOOL_ERROR and "no readable text" in error
    status, _, _, error = run_job(visit_spec().target, {"url": "world://p1"}, [], ToolBackendsConfig())
    assert status is ToolStatus.INFRA_ERROR and "corpus_path" in error


def test_online_visit_goes_through_jina_reader(monkeypatch):
    seen = []

    def reader(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("authorization")))
        return httpx.Response(200, text=PAGE)

    client = httpx.Client(transport=httpx.MockTransport(reader))
    monkeypatch.setattr(http_client, "shared_client", lambda timeout_s: client)
    online = TextSearchConfig(
        backend="online", serper_key="k", summarizer_url="http://s/v1", jina_url="http://reader.test/", jina_key="jk"
    )
    config = ToolBackendsConfig(text_search=online)
    out = visit_tool({"url": "https://example.org/kessock", "goal": ""}, [], config)
    assert "opened in 1982" in out.text
    assert seen == [("http://reader.test/https://example.org/kessock", "Bearer jk")]
    status, _, _, error = run_job(visit_spec().target, {"url": "file:///etc/passwd"}, [], config)
    assert status is ToolStatus.TOOL_ERROR and "http" in error


def test_focus_page_keeps_goal_paragraphs_in_page_order():
    assert focus_page(PAGE, "bridge", 10_000) == PAGE
    assert focus_page(PAGE, "Kessock bridge 1982", 60) == "The Kessock Bridge opened in 1982 near Inverness."
    assert focus_page(PAGE, "", 12) == PAGE[:12]
