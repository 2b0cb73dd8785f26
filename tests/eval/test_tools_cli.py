"""``python -m osvl.eval`` tool plumbing: TOML / flags / env-var keys -> ToolBackendsConfig, the release tool
profile and a user system prompt, driven for real against loopback online back-ends."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from osvl.eval.__main__ import (
    build_answerer,
    build_parser,
    main,
    tool_environment,
    tools_config,
)
from osvl.eval.benchmarks import load_benchmark
from osvl.eval.items import to_prompt
from osvl.eval.judge import NormalizedMatchJudge
from osvl.eval.model_dir import load_model_dir
from osvl.eval.runner import EvalRunConfig, Evaluator, read_records
from osvl.eval.tools import EvalToolEnvironment, check_offline_paths, tool_sections
from osvl.model import from_pretrained
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.tools import ToolEnvironment, profiles, tool_profile
from osvl.tools.config_file import read_tools_file, resolve_sections
from tests.eval.helpers import rgb, write_jsonl, write_png
from tests.tools.loopback import LoopbackServer, Reply

PAGE = "# Kessock Bridge\nThe Kessock Bridge opened in 1982 over the Beauly Firth."


@pytest.fixture()
def web():
    server = LoopbackServer()

    def serper(request):
        if request.headers.get("x-api-key") != "serper-secret":
            return Reply(403, {"message": "Unauthorized"})
        return Reply(
            200,
            {
                "organic": [
                    {
                        "title": "Kessock Bridge",
                        "link": "https://example.org/kessock",
                        "snippet": "A bridge",
                        "position": 1,
                    }
                ]
            },
        )

    def summarizer(request):
        if request.headers.get("authorization") != "Bearer llm-secret":
            return Reply(401, {"error": {"message": "bad key"}})
        return Reply(
            200,
            {
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "It opened in 1982."},
                    }
                ]
            },
        )

    server.routes.update(
        {
            "/search": serper,
            "/read/": [Reply(200, PAGE, {"content-type": "text/plain"})],
            "/v1/chat/completions": summarizer,
        }
    )
    yield server
    server.close()


def _toml(path, web, **extra):
    lines = [
        "[text_search]",
        'backend = "online"',
        f'serper_url = "{web.url}/search"',
        f'jina_url = "{web.url}/read/"',
        'serper_key_env = "OSVL_TEST_SERPER"',
        "[http]",
        "timeout_s = 5.0",
        "max_retries = 0",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_keys_come_from_named_environment_variables_only():
    env = {"SERPER": "s-key", "LLM": "l-key"}
    config = resolve_sections(
        {
            "text_search": {
                "backend": "online",
                "serper_key_env": "SERPER",
                "summarizer_url": "http://x/v1",
                "summarizer_key_env": "LLM",
            },
            "image_search": {"backend": "online", "api_url": "http://y", "api_key_env": "LLM"},
            "http": {"timeout_s": 3.0},
        },
        env,
    )
    assert (config.text_search.serper_key, config.text_search.summarizer_key) == ("s-key", "l-key")
    assert config.image_search.api_key == "l-key" and config.http.timeout_s == 3.0
    with pytest.raises(ValueError, match="names environment variable 'NOPE', which is not set"):
        resolve_sections({"text_search": {"serper_key_env": "NOPE"}}, env)
    with pytest.raises(ValueError, match=r"\[text_search\] serper_key: secrets are not read from files or flags"):
        resolve_sections({"text_search": {"serper_key": "literal"}}, env)
    with pytest.raises(ValueError, match=r"\[ocr\] paddlex_token: secrets"):
        resolve_sections({"ocr": {"paddlex_token": "literal"}}, env)
    with pytest.raises(ValueError, match=r"\[text_search\] unknown field 'serper'; known: .*serper_key_env"):
        resolve_sections({"text_search": {"serper": "x"}}, env)
    with pytest.raises(ValueError, match="unknown tools section 'web'"):
        resolve_sections({"web": {}}, env)
    with pytest.raises(ValueError, match="needs serper_key and summarizer_url"):
        resolve_sections({"text_search": {"backend": "online", "serper_key_env": "SERPER"}}, env)
    assert not any(o.endswith(("-key", "-token")) for a in build_parser()._actions for o in a.option_strings)


def test_toml_file_flags_and_world_combine(tmp_path, web):
    path = _toml(tmp_path / "tools.toml", web)
    flags = {"summarizer_url": f"{web.url}/v1", "summarizer_key_env": "OSVL_TEST_LLM", "jina_url": "http://j/"}
    sections = tool_sections(str(path), flags, "/w")
    assert sections["text_search"]["jina_url"] == "http://j/"  # a flag beats the file
    assert sections["text_search"]["serper_url"] == f"{web.url}/search"
    assert sections["image_search"] == {"collection_path": "/w/images.jsonl"}
    assert sections["text_search"]["corpus_path"] == "/w/corpus.jsonl"
    (tmp_path / "bad.toml").write_text("[text_search\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        read_tools_file(tmp_path / "bad.toml")
    (tmp_path / "sec.toml").write_text("[websearch]\nx = 1\n")
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['websearch'\]"):
        read_tools_file(tmp_path / "sec.toml")
    with pytest.raises(ValueError, match="tools config file .* does not exist"):
        read_tools_file(tmp_path / "none.toml")


def test_offline_back_ends_need_their_data_files(tmp_path):
    with pytest.raises(ValueError, match="text_search is offline but has no corpus_path"):
        check_offline_paths(resolve_sections({}, {}))
    missing = resolve_sections(tool_sections(None, {}, str(tmp_path)), {})
    with pytest.raises(ValueError, match="text_search corpus_path not found: .*corpus.jsonl"):
        check_offline_paths(missing)
    (tmp_path / "corpus.jsonl").write_text("")
    with pytest.raises(ValueError, match="image_search collection_path not found"):
        check_offline_paths(missing)
    (tmp_path / "images.jsonl").write_text("")
    check_offline_paths(missing)


def _bench(tmp_path):
    write_png(tmp_path / "q.png", rgb(seed=4))
    return write_jsonl(
        tmp_path / "vdr.jsonl",
        [
            {"id": "a", "question": "When did the Kessock Bridge open?", "answer": "1982", "image": "q.png"},
            {
                "id": "b",
                "question": "Which firth does the Forth Bridge cross?",
                "answer": "Firth of Forth",
                "image": "q.png",
            },
        ],
    )


def test_release_profile_with_online_search_and_own_system_prompt(checkpoint, world_dir, tmp_path, web, monkeypatch):
    """A release-named call (web_search, "q") goes through the CLI's tool stack to the loopback Serper
    with the key from the environment; the checkpoint sees the release schema and the user's prompt."""
    monkeypatch.setenv("OSVL_TEST_SERPER", "serper-secret")
    monkeypatch.setenv("OSVL_TEST_LLM", "llm-secret")
    prompt_file = tmp_path / "release_prompt.txt"
    prompt_file.write_text("You are a visual investigation agent. Use img_1 for the question image.\n")
    bench = _bench(tmp_path)
    args = build_parser().parse_args(
        [
            "--checkpoint",
            str(checkpoint),
            "--bench",
            f"vdr={bench}",
            "--mode",
            "agentic",
            "--out",
            str(tmp_path / "o"),
            "--world",
            str(world_dir),
            "--tools",
            str(_toml(tmp_path / "tools.toml", web)),
            "--tool-profile",
            "release",
            "--system-prompt",
            str(prompt_file),
            "--summarizer-url",
            f"{web.url}/v1",
            "--summarizer-key-env",
            "OSVL_TEST_LLM",
        ]
    )
    config = tools_config(args)
    assert config.text_search.backend == "online" and config.text_search.serper_key == "serper-secret"
    assert config.image_search.collection_path == str(world_dir / "images.jsonl")

    model_dir = load_model_dir(checkpoint)
    tokenizer = model_dir.tokenizer
    header = tokenizer.encode("<|im_start|>assistant\n")

    def script(request):
        ids = request.input_ids
        turn = sum(ids[i : i + len(header)] == header for i in range(len(ids))) - 1
        text = tokenizer.decode(ids)
        if turn == 0:
            return tokenizer.encode(
                '<think>search</think><tool_call>{"name": "web_search", '
                '"arguments": {"q": "Kessock Bridge opening"}}</tool_call>'
            )
        answer = "1982" if "Kessock Bridge open" in text and "opened in 1982" in text else "no idea"
        return tokenizer.encode(f"<think>ok</think><response>{answer}</response>")

    engine = ReplayEngine(
        LocalEngine(from_pretrained(checkpoint, dtype=torch.float32), tokenizer, model_dir.image_config), script
    )
    items = load_benchmark(bench, "vdr").items
    with tool_environment(args) as env:
        answerer = build_answerer(args, engine, model_dir, env)
        system = tokenizer.decode(answerer.renderer.render_prompt(to_prompt(items[0])).ids)
        assert "You are a visual investigation agent." in system
        assert '"name": "web_search"' in system and '"name": "layout_parsing"' in system
        assert '"name": "ocr"' not in system
        stats = asyncio.run(Evaluator(answerer, NormalizedMatchJudge(), tmp_path / "o", EvalRunConfig(2)).run(items))
    assert stats.generated == 2
    records, _ = read_records(tmp_path / "o" / "records.jsonl")
    assert {r["id"]: r["verdict"]["score"] for r in records.values()} == {"a": 1.0, "b": 0.0}
    step = records["vdr/a"]["trajectory"]["steps"][0]
    assert step["tool_result"]["status"] == "ok" and step["tool_result"]["tool"] == "text_search"
    assert "1982" in step["tool_result"]["text"]
    searches = web.hits("/search")
    assert len(searches) == 2 and searches[0].json()["q"] == "Kessock Bridge opening"
    assert all(r.headers["x-api-key"] == "serper-secret" for r in searches)
    assert web.hits("/v1/chat/completions")[0].headers["authorization"] == "Bearer llm-secret"


def test_cli_refuses_bad_tool_settings_before_loading_the_model(
    checkpoint, world_dir, tmp_path, web, capsys, monkeypatch
):
    monkeypatch.delenv("OSVL_TEST_SERPER", raising=False)
    base = [
        "--checkpoint",
        str(tmp_path / "no-model"),
        "--bench",
        f"vdr={_bench(tmp_path)}",
        "--mode",
        "agentic",
        "--out",
        str(tmp_path / "o"),
        "--world",
        str(world_dir),
    ]
    assert main(base + ["--tools", str(_toml(tmp_path / "t.toml", web))]) == 2
    assert "serper_key_env names environment variable 'OSVL_TEST_SERPER', which is not set" in capsys.readouterr().err
    assert main(base + ["--system-prompt", str(tmp_path / "none.txt")]) == 2
    assert "--system-prompt file not found" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("  \n")  # no system prompt: accepted, so the run gets to the model
    assert main(base + ["--system-prompt", str(tmp_path / "empty.txt")]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert main(base[:-2] + ["--image-search-backend", "online"]) == 2
    assert "needs api_url" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--tool-profile", "llama"])


def test_profiled_environment_is_the_tools_one_over_the_osvl_environment_rag_uses():
    profile = tool_profile("release")
    osvl_env = ToolEnvironment(profile.registry, pool=object())
    env = EvalToolEnvironment(osvl_env, profile)
    assert isinstance(env, profiles.ProfiledEnvironment) and env.profile is profile
    assert env.env is osvl_env and env.pool is osvl_env.pool and env.registry is profile.registry
    assert env.tool_schemas() == profile.tool_schemas() != profile.registry.tool_schemas()
