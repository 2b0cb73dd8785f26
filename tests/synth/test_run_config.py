"""``python -m osvl.synth run`` configuration: TOML + flags -> SynthRunConfig, and its error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig
from osvl.synth.__main__ import main
from osvl.synth.backends import open_backends, page_context, tools_config
from osvl.synth.expert import WorldTools
from osvl.synth.filtering import SolverAnswer
from osvl.synth.llm_access import LLMUnavailable, LLMUsage, MeteredChat
from osvl.synth.pipeline import question_image
from osvl.synth.records import read_items
from osvl.synth.run_config import build_run_config, read_toml, secret
from osvl.synth.tool_solvers import ChatImageSearchSolver, SolverUnavailable

from .chat_server import LoopbackChat

EXAMPLE = Path(__file__).resolve().parents[2] / "osvl" / "synth" / "configs" / "wikipedia_llm.toml"
LLM = {"url": "http://127.0.0.1:9/v1", "model": "m"}


def test_defaults_are_the_offline_pipeline():
    config = build_run_config({"source": {"world": "w"}})
    assert config.stages.llm_stages == () and config.tools.mode == "exact"
    assert config.curation.seed == 0 and config.curation.expert_tools == "exact"


def test_example_config_validates_and_selects_every_llm_stage():
    config = build_run_config(read_toml(EXAMPLE))
    assert config.stages.llm_stages == ("rewrite", "uniqueness", "closed_book", "image_search", "expert")
    assert config.source.graph and config.llm.api_key_env == "OPENAI_API_KEY"
    assert config.curation.expert_tools == "environment" and config.curation.tool_workers == 4


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"source": {"world": "w"}, "sorce": {}}, "unknown key(s) sorce"),
        ({"source": {"world": "w"}, "llm": {"urll": "x"}}, "unknown key(s) llm.urll"),
        (
            {"source": {"world": "w"}, "curation": {"rollouts_per_item": "two"}},
            "curation.rollouts_per_item: expected an integer",
        ),
        ({"source": {"world": "w"}, "stages": {"expert": "gpt"}}, "stages.expert: 'gpt' is not one of"),
        (
            {"source": {"world": "w"}, "stages": {"expert": "llm"}},
            "stages expert use the LLM: set llm.url and llm.model",
        ),
        (
            {
                "source": {"world": "w"},
                "llm": LLM,
                "stages": {"rewrite": "llm", "uniqueness": "llm", "closed_book": "llm"},
            },
            "rewrite = 'llm' needs uniqueness, closed_book and image_search = 'llm'",
        ),
        (
            {
                "source": {"world": "w"},
                "llm": LLM,
                "stages": {"rewrite": "llm", "uniqueness": "llm", "closed_book": "llm", "image_search": "llm"},
            },
            "curation.text_search_filter = false",
        ),
        ({"source": {}}, "set exactly one of world"),
        ({"source": {"world": "w", "graph": "g.jsonl"}}, "set exactly one of world"),
        ({"source": {"graph": "g.jsonl"}}, "a graph source needs images"),
        ({"source": {"world": "w", "hub_threshold": 5}}, "sampling thresholds apply to a graph source"),
        (
            {"source": {"world": "w"}, "curation": {"expert_tools": "environment"}},
            "curation.expert_tools: set tools.mode",
        ),
        ({"source": {"world": "w"}, "tools": {"text_search": "online"}}, "online tool back-ends need the tool pool"),
        (
            {"source": {"world": "w"}, "tools": {"image_search": "online"}},
            "image_search = 'online' needs image_search_url",
        ),
        ({"source": {"world": "w"}, "llm": {"url": "ftp://x"}}, "llm: url must be an http(s) URL"),
        ({"source": {"world": "w"}, "budget": {"max_llm_calls": -1}}, "budget: max_llm_calls must be >= 0"),
        ({"source": "w"}, "source: expected a table"),
        (
            {"source": {"world": "w"}, "curation": {"solver_budget": "x"}},
            "curation.solver_budget: value of the wrong type",
        ),
    ],
)
def test_invalid_configs_name_the_key(raw, message):
    with pytest.raises(ValueError) as error:
        build_run_config(raw)
    assert message in str(error.value)


def test_read_toml_rejects_missing_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[llm\nurl = 1\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        read_toml(bad)


def test_secret_reads_only_named_variables(monkeypatch):
    assert secret("", "llm.api_key_env") is None
    monkeypatch.delenv("OSVL_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="llm.api_key_env: environment variable OSVL_TEST_KEY is not set"):
        secret("OSVL_TEST_KEY", "llm.api_key_env")
    monkeypatch.setenv("OSVL_TEST_KEY", "sk-test")
    assert secret("OSVL_TEST_KEY", "llm.api_key_env") == "sk-test"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--llm-stages", "expert,telepathy"], "unknown stage 'telepathy'"),
        (["--llm-stages", "expert"], "set llm.url and llm.model"),
        (["--config", "missing.toml"], "config file missing.toml does not exist"),
        (["--rollouts", "0"], "rollouts_per_item and per_domain must be >= 1"),
        (["--graph", "g.jsonl"], "set exactly one of world"),  # --world and --graph together
    ],
)
def test_cli_rejects_bad_configuration_before_writing(world, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--world", str(world.root), "--out", str(out), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_cli_names_an_unset_key_variable(world, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OSVL_UNSET_KEY", raising=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        main(
            [
                "run",
                "--world",
                str(world.root),
                "--out",
                str(out),
                "--llm-url",
                "http://127.0.0.1:9/v1",
                "--llm-model",
                "m",
                "--llm-api-key-env",
                "OSVL_UNSET_KEY",
                "--llm-stages",
                "filter",
            ]
        )
    assert "environment variable OSVL_UNSET_KEY is not set" in capsys.readouterr().err
    assert not out.exists()


def test_cli_rejects_a_missing_graph_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--graph", str(tmp_path / "graph.jsonl"), "--images", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "graph file" in capsys.readouterr().err and not (tmp_path / "o").exists()


def _metered(server, usage, cache=None, stage="rewrite"):
    client = ChatCompletionsClient(ChatJudgeConfig(server.base_url, "m", max_attempts=1), sleep=lambda _: None)
    return MeteredChat(client, stage, usage, cache)


def test_metered_chat_caches_counts_and_budgets(tmp_path):
    with LoopbackChat(lambda prompt: (200, f"echo {prompt}")) as server:
        usage = LLMUsage(max_calls=2)
        chat = _metered(server, usage, tmp_path / "rewrite.jsonl")
        assert chat.complete([{"role": "user", "content": "a"}]).text == "echo a"
        assert chat.complete([{"role": "user", "content": "a"}]).text == "echo a"  # cached
        assert chat.complete([{"role": "user", "content": "b"}]).text == "echo b"
        with pytest.raises(LLMUnavailable, match="budget of 2 calls is spent"):
            chat.complete([{"role": "user", "content": "c"}])
        assert len(server.prompts) == 2
        assert usage.to_dict() == {
            "max_calls": 2,
            "calls": {"rewrite": 2},
            "cache_hits": {"rewrite": 1},
            "failures": {},
        }
        reloaded = _metered(server, LLMUsage(max_calls=0), tmp_path / "rewrite.jsonl")
        assert reloaded.complete([{"role": "user", "content": "b"}]).text == "echo b"  # from disk, no call
    with pytest.raises(ValueError, match="max LLM calls must be >= 0"):
        LLMUsage(max_calls=-1)


def test_metered_chat_raises_on_outages_and_returns_request_errors():
    replies = iter([(503, "down"), (401, "bad key"), (400, "too long")])
    with LoopbackChat(lambda prompt: next(replies)) as server:
        usage = LLMUsage()
        chat = _metered(server, usage, stage="expert")
        for error in ("http_503", "http_401"):
            with pytest.raises(LLMUnavailable, match=error):
                chat.complete([{"role": "user", "content": "x"}])
        assert chat.complete([{"role": "user", "content": "x"}]).error == "http_400"
        assert usage.failures == {"expert": 3} and chat.config.model == "m"


def test_default_backends_replace_nothing(world, tmp_path):
    with open_backends(build_run_config({"source": {"world": str(world.root)}}), tmp_path) as backends:
        assert backends.curate_kwargs == {} and backends.usage is None and backends.world.root == world.root


def test_tools_config_switches_search_online_with_keys_from_the_environment(world, tmp_path, monkeypatch):
    raw = {
        "source": {"world": str(world.root)},
        "llm": {**LLM, "api_key_env": "OSVL_LLM_KEY"},
        "tools": {
            "mode": "environment",
            "text_search": "online",
            "serper_key_env": "OSVL_SERPER_KEY",
            "image_search": "online",
            "image_search_url": "http://127.0.0.1:9/search",
        },
    }
    config = build_run_config(raw)
    monkeypatch.delenv("OSVL_SERPER_KEY", raising=False)
    with pytest.raises(ValueError, match="tools.serper_key_env: environment variable OSVL_SERPER_KEY"):
        tools_config(config, world, tmp_path)
    monkeypatch.setenv("OSVL_SERPER_KEY", "serper-secret")
    monkeypatch.setenv("OSVL_LLM_KEY", "llm-secret")
    tools = tools_config(config, world, tmp_path)
    assert tools.text_search.backend == "online" and tools.text_search.serper_key == "serper-secret"
    assert tools.text_search.summarizer_url == LLM["url"] and tools.text_search.summarizer_key == "llm-secret"
    assert tools.image_search.backend == "online" and tools.image_search.api_url == "http://127.0.0.1:9/search"
    offline = tools_config(build_run_config({"source": {"world": str(world.root)}}), world, tmp_path)
    assert offline.text_search.corpus_path == str(world.corpus_path)


def test_page_context_states_graph_facts_without_text(world):
    page = next(p for p in world.graph.entities() if p.infobox and p.links)
    context = page_context(world.graph)(page.id)
    key, value = next(iter(sorted(page.infobox.items())))
    assert context.startswith(page.title) and f"{key}: {value}" in context


def test_chat_image_search_solver_answers_from_one_real_search(world, curated):
    out, _ = curated
    item = next(i for i in read_items(out / "items.jsonl") if i.degradation is None)
    replies = iter([(200, json.dumps({"answer": item.answer})), (200, '{"answer": null}'), (503, "down")])
    with LoopbackChat(lambda prompt: next(replies)) as server:
        client = ChatCompletionsClient(ChatJudgeConfig(server.base_url, "m", max_attempts=1), sleep=lambda _: None)
        solver = ChatImageSearchSolver(client, WorldTools(world), lambda i: question_image(world, out, i))
        assert solver.solve(item) == SolverAnswer(item.answer, 1)
        anchor = world.graph[item.path[0]].title
        assert server.prompts[0].startswith("You may not search further") and f"[Match 1] {anchor}" in server.prompts[0]
        assert solver.solve(item) == SolverAnswer(None, 1)
        with pytest.raises(SolverUnavailable, match="http_503"):
            solver.solve(item)
        assert solver.name == "chat_image_search:m:top3:v1"
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        ChatImageSearchSolver(client, WorldTools(world), lambda i: question_image(world, out, i), top_k=0)
