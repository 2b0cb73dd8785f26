"""Online backends against real HTTP servers on loopback speaking Serper, Jina Reader, OpenAI chat,
PaddleX layout parsing and a reverse-image API, including their failure modes."""

import base64
import json
import time

import numpy as np
import pytest

from osvl.rl.trajectory import ToolStatus
from osvl.tools import BackendError, HttpConfig, ImageSearchConfig, OcrConfig, TextSearchConfig, ToolBackendsConfig
from osvl.tools.http_client import request_json
from osvl.tools.image_io import decode_image
from osvl.tools.worker import run_job
from tests.tools.images import scene
from tests.tools.loopback import LoopbackServer, Reply

FAST = HttpConfig(timeout_s=0.5, max_retries=2, max_retry_after_s=1.0, backoff_s=0.01)
PAGES = {
    "https://example.org/kessock": "# Kessock Bridge\nThe Kessock Bridge opened in 1982. It spans the Beauly Firth.",
    "https://example.org/forth": "# Forth Bridge\nThe Forth Bridge opened in 1890.",
}


@pytest.fixture()
def web():
    server = LoopbackServer()

    def serper(request):
        if request.headers.get("x-api-key") != "serper-key":
            return Reply(403, {"message": "Unauthorized"})
        body = request.json()
        organic = [
            {
                "title": "Kessock Bridge - Wikipedia",
                "link": "https://example.org/kessock",
                "snippet": "Kessock Bridge snippet",
                "position": 1,
            },
            {"title": "Forth Bridge", "link": "https://example.org/forth", "snippet": "Forth snippet", "position": 2},
            {"title": "Gone", "link": "https://example.org/gone", "snippet": "Gone snippet", "position": 3},
        ]
        return Reply(200, {"searchParameters": {"q": body["q"]}, "organic": organic[: body["num"]]})

    def jina(request):
        url = request.path[len("/read/") :]
        return Reply(200, PAGES[url], {"content-type": "text/plain"}) if url in PAGES else Reply(404, "not found")

    def chat(request):
        if request.headers.get("authorization") != "Bearer llm-key":
            return Reply(401, {"error": {"message": "bad key"}})
        prompt = request.json()["messages"][0]["content"]
        page = prompt.split("Page:\n", 1)[1]
        first_fact = page.splitlines()[1]
        return Reply(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": f"{first_fact}"}, "finish_reason": "stop"}
                ],
            },
        )

    server.routes.update({"/search": serper, "/read/": jina, "/v1/chat/completions": chat})
    yield server
    server.close()


def text_config(web, **overrides):
    settings = dict(
        backend="online",
        serper_url=f"{web.url}/search",
        serper_key="serper-key",
        jina_url=f"{web.url}/read/",
        summarizer_url=f"{web.url}/v1",
        summarizer_key="llm-key",
    )
    settings.update(overrides)
    return ToolBackendsConfig(http=FAST, text_search=TextSearchConfig(**settings))


def search(config, query="Kessock Bridge opening year", top_k=3):
    return run_job("osvl.tools.text_search:text_search_tool", {"query": query, "top_k": top_k}, [], config)


def test_serper_jina_summarizer_pipeline(web):
    status, text, _, error = search(text_config(web))
    assert status is ToolStatus.OK, error
    passages = text.split("\n\n")
    assert passages[0] == (
        "[Passage 1] Kessock Bridge - Wikipedia\nURL: https://example.org/kessock\n"
        "Summary: The Kessock Bridge opened in 1982. It spans the Beauly Firth."
    )
    assert passages[1].endswith("Summary: The Forth Bridge opened in 1890.")
    assert passages[2].endswith("Summary: Gone snippet (page unavailable; search snippet)")
    summarizer_request = web.hits("/v1/chat/completions")[0].json()
    assert (
        summarizer_request["model"] == "Qwen3-32B"
        and "Query: Kessock Bridge opening year" in summarizer_request["messages"][0]["content"]
    )
    assert web.hits("/search")[0].json() == {"q": "Kessock Bridge opening year", "num": 3}


def test_auth_failures_are_infra_errors_without_retry(web):
    status, _, _, error = search(text_config(web, serper_key="wrong"))
    assert status is ToolStatus.INFRA_ERROR and "Serper rejected our credentials (HTTP 403)" in error
    assert len(web.hits("/search")) == 1
    status, _, _, error = search(text_config(web, summarizer_key="wrong"))
    assert status is ToolStatus.INFRA_ERROR and "summarizer rejected our credentials (HTTP 401)" in error


def test_429_with_retry_after_is_honoured(web):
    serper = web.routes["/search"]
    calls = []

    def limited(request):
        calls.append(time.monotonic())
        if len(calls) == 1:
            return Reply(429, {"message": "slow down"}, {"Retry-After": "0.3"})
        return serper(request)

    web.routes["/search"] = limited
    status, text, _, error = search(text_config(web), top_k=1)
    assert status is ToolStatus.OK, error
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.28


def test_429_with_a_long_retry_after_gives_up_at_once(web):
    web.routes["/search"] = [Reply(429, "", {"Retry-After": "120"})]
    status, _, _, error = search(text_config(web))
    assert status is ToolStatus.INFRA_ERROR and "retry after 120s" in error
    assert len(web.hits("/search")) == 1


def test_5xx_is_retried_then_reported(web):
    serper = web.routes["/search"]
    web.routes["/search"] = [Reply(503, "busy"), Reply(502, "bad gateway"), serper]
    status, _, _, error = search(text_config(web), top_k=1)
    assert status is ToolStatus.OK, error
    web.routes["/search"] = [Reply(500, "down")]
    status, _, _, error = search(text_config(web), top_k=1)
    assert status is ToolStatus.INFRA_ERROR and "HTTP 500 after 3 attempts" in error


def test_slow_backend_times_out(web):
    web.routes["/search"] = [Reply(200, {"organic": []}, delay_s=2.0)]
    started = time.monotonic()
    status, _, _, error = search(
        text_config(
            web,
        ),
        top_k=1,
    )
    assert status is ToolStatus.INFRA_ERROR and "did not answer within 0.5s" in error
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize(
    "reply, message",
    [
        (Reply(200, "<html>oops</html>"), "not JSON"),
        (Reply(200, {"results": []}), "no 'organic' result list"),
    ],
)
def test_malformed_search_bodies(web, reply, message):
    web.routes["/search"] = [reply]
    status, _, _, error = search(text_config(web))
    assert status is ToolStatus.INFRA_ERROR and message in error


def test_malformed_summarizer_body(web):
    web.routes["/v1/chat/completions"] = [Reply(200, {"choices": []})]
    status, _, _, error = search(text_config(web), top_k=1)
    assert status is ToolStatus.INFRA_ERROR and "choices[0].message.content" in error


def test_no_search_results_is_a_tool_error(web):
    web.routes["/search"] = [Reply(200, {"organic": []})]
    status, _, _, error = search(text_config(web))
    assert status is ToolStatus.TOOL_ERROR and "no results" in error


def test_paddlex_layout_parsing_protocol(web):
    image = scene(9, (40, 60))

    def paddlex(request):
        if request.headers.get("authorization") != "token px":
            return Reply(403, {"errorCode": 403, "errorMsg": "Forbidden"})
        body = request.json()
        received = decode_image(base64.b64decode(body["file"]), 10**6)
        assert np.array_equal(received, image) and body["fileType"] == 1 and body["useChartRecognition"] is True
        blocks = [
            {"block_label": "doc_title", "block_content": "Annual Report", "block_bbox": [1, 2, 30, 9]},
            {"block_label": "text", "block_content": "Profit rose.", "block_bbox": [1, 12, 50, 20]},
        ]
        return Reply(
            200,
            {
                "logId": "1",
                "errorCode": 0,
                "errorMsg": "Success",
                "result": {
                    "layoutParsingResults": [
                        {
                            "prunedResult": {"parsing_res_list": blocks},
                            "markdown": {"text": "# Annual Report\n\nProfit rose."},
                        }
                    ],
                    "dataInfo": {"type": "image"},
                },
            },
        )

    web.routes["/layout-parsing"] = paddlex
    config = ToolBackendsConfig(
        http=FAST, ocr=OcrConfig(backend="paddlex", paddlex_url=f"{web.url}/layout-parsing", paddlex_token="px")
    )
    arguments = {"image": 0, "chart_recognition": True, "doc_orientation": False}
    status, text, _, error = run_job("osvl.tools.ocr:ocr_tool", arguments, [image], config)
    assert status is ToolStatus.OK, error
    observation = json.loads(text)
    assert observation["blocks"][0] == {
        "block_label": "doc_title",
        "block_content": "Annual Report",
        "block_bbox": [1, 2, 30, 9],
    }
    assert observation["formatted_text"] == "# Annual Report\n\nProfit rose."
    web.routes["/layout-parsing"] = [Reply(200, {"errorCode": 500, "errorMsg": "model crashed"})]
    status, _, _, error = run_job("osvl.tools.ocr:ocr_tool", arguments, [image], config)
    assert status is ToolStatus.INFRA_ERROR and "PaddleX OCR error 500: model crashed" in error
    web.routes["/layout-parsing"] = [Reply(200, {"errorCode": 0, "result": {"layoutParsingResults": [{}]}})]
    status, _, _, error = run_job("osvl.tools.ocr:ocr_tool", arguments, [image], config)
    assert status is ToolStatus.INFRA_ERROR and "unexpected shape" in error


def test_reverse_image_search_by_uploaded_url_and_inline(web):
    image = scene(10, (30, 30))
    uploads = []

    def upload(request):
        uploads.append(request.json()["image_base64"])
        return Reply(200, {"url": "https://img.example.org/abc.png"})

    def reverse(request):
        body = request.json()
        source = body.get("image_url", "inline")
        return Reply(
            200,
            {
                "results": [
                    {"title": "Kessock Bridge", "snippet": f"via {source}", "url": "https://w/k", "score": 0.93}
                ][: body["top_k"]]
            },
        )

    web.routes.update({"/upload": upload, "/reverse": reverse})
    settings = dict(backend="online", api_url=f"{web.url}/reverse")
    by_url = ToolBackendsConfig(http=FAST, image_search=ImageSearchConfig(upload_url=f"{web.url}/upload", **settings))
    status, text, _, error = run_job(
        "osvl.tools.image_search:image_search_tool", {"image": 0, "top_k": 2}, [image], by_url
    )
    assert status is ToolStatus.OK, error
    assert (
        text
        == "[Match 1] Kessock Bridge (page: https://w/k; web, score 0.93)\nCaption: via https://img.example.org/abc.png"
    )
    assert np.array_equal(decode_image(base64.b64decode(uploads[0]), 10**6), image)
    inline = ToolBackendsConfig(http=FAST, image_search=ImageSearchConfig(**settings))
    status, text, _, _ = run_job("osvl.tools.image_search:image_search_tool", {"image": 0, "top_k": 2}, [image], inline)
    assert status is ToolStatus.OK and text.endswith("Caption: via inline")
    assert "image_base64" in web.hits("/reverse")[-1].json()
    web.routes["/reverse"] = [Reply(200, {"matches": []})]
    status, _, _, error = run_job(
        "osvl.tools.image_search:image_search_tool", {"image": 0, "top_k": 2}, [image], inline
    )
    assert status is ToolStatus.INFRA_ERROR and "no 'results' list" in error


def test_unreachable_service():
    with pytest.raises(BackendError, match="unreachable"):
        request_json("nowhere", "GET", "http://127.0.0.1:9/", FAST)


def test_online_configs_need_their_settings():
    with pytest.raises(ValueError, match="needs serper_key and summarizer_url"):
        TextSearchConfig(backend="online")
    with pytest.raises(ValueError, match="needs api_url"):
        ImageSearchConfig(backend="online")
    with pytest.raises(ValueError, match="timeout_s"):
        HttpConfig(timeout_s=0)
