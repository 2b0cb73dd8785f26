"""The harness end to end on the mini-world's held-out questions, offline: CLI with a tiny random
checkpoint (direct and agentic), and a scripted agent through the real loop, tools and renderer."""

from __future__ import annotations

import asyncio
import json

import pytest

from osvl.data.chat import ChatRenderer
from osvl.eval.__main__ import main
from osvl.eval.benchmarks import load_benchmark
from osvl.eval.judge import NormalizedMatchJudge
from osvl.eval.modes import AgenticAnswerer, system_prompt
from osvl.eval.runner import EvalRunConfig, Evaluator, read_records
from osvl.rl.trajectory import ImageStore, trajectory_from_dict
from osvl.rollout.agent import AgentConfig
from osvl.rollout.engine import GenerationRequest, SamplingParams
from osvl.rollout.local_engine import LocalEngine, ReplayEngine
from osvl.tools import (
    ImageSearchConfig,
    PoolConfig,
    TextSearchConfig,
    ToolBackendsConfig,
    ToolEnvironment,
    ToolPool,
    default_registry,
)
from tests.eval.conftest import IMAGE_CONFIG

N = 4


def _cli(checkpoint, held_out, out, mode, world=None):
    argv = [
        "--checkpoint",
        str(checkpoint),
        "--bench",
        f"world:osvl={held_out}",
        "--mode",
        mode,
        "--out",
        str(out),
        "--limit",
        str(N),
        "--concurrency",
        "2",
        "--max-new-tokens",
        "8",
        "--max-turns",
        "2",
        "--max-total-tokens",
        "4096",
        "--dtype",
        "float32",
        "--temperature",
        "1.0",
    ]
    return main(argv + (["--world", str(world)] if world else []))


@pytest.mark.parametrize("mode", ["direct", "rag", "agentic"])
def test_cli_runs_a_tiny_checkpoint_on_held_out_questions_and_resumes(
    checkpoint, held_out, world_dir, tmp_path, mode, capsys
):
    out = tmp_path / mode
    assert _cli(checkpoint, held_out, out, mode, None if mode == "direct" else world_dir) == 0
    records, corrupt = read_records(out / "records.jsonl")
    assert corrupt == 0 and len(records) == N
    store = ImageStore(out / "images")
    for record in records.values():
        assert record["mode"] == mode and record["status"] == "judged"
        assert record["verdict"]["judge"] == "offline:normalized_match" and record["verdict"]["score"] in (0.0, 1.0)
        traj = trajectory_from_dict(record["trajectory"], store)
        assert traj.prompt.id == f"world/{record['id']}" and traj.prompt.images
        assert record["generated_tokens"] == sum(len(s.token_ids) for s in traj.steps) > 0
        assert record["context_tokens"] > record["generated_tokens"]
        if mode == "direct":
            assert record["tool_calls"] == 0 and len(traj.steps) == 1
        elif mode == "rag":
            assert record["tool_calls"] == 2 and [r["tool"] for r in record["retrieval"]] == [
                "text_search",
                "image_search",
            ]
            assert record["retrieval"][0]["status"] == "ok" and "Search results" in traj.prompt.question
        else:
            assert record["tool_calls"] == sum(s.tool_result is not None for s in traj.steps)
    summary = json.loads((out / "summary.json").read_text())
    [bench] = summary["benchmarks"]
    assert bench["benchmark"] == "world" and bench["judged"] == N and summary["run"]["generated"] == N
    assert summary["tool_profile"] == (None if mode == "direct" else "paper")
    assert summary["system_prompt_source"] == "shipped" and summary["system_turn_sha256"]  # a foreign template
    assert bench["pass_at_1"] == pytest.approx(100.0 * bench["correct"] / N)
    table = (out / "table.md").read_text()
    assert "| world | Avg |" in table and "no paper numbers shown" in table and "paper:" not in table
    assert table == capsys.readouterr().out
    # resumed: every item is judged already, nothing is generated again
    assert _cli(checkpoint, held_out, out, mode, None if mode == "direct" else world_dir) == 0
    again = json.loads((out / "summary.json").read_text())["run"]
    assert (again["generated"], again["skipped"]) == (0, N)
    assert sum(1 for line in (out / "records.jsonl").open() if line.strip()) == N


def test_cli_errors_are_clear(checkpoint, held_out, tmp_path, capsys):
    base = ["--checkpoint", str(checkpoint), "--out", str(tmp_path)]
    assert main(base + ["--bench", f"vqa={held_out}", "--mode", "direct"]) == 2
    assert "unknown benchmark format 'vqa'" in capsys.readouterr().err
    assert main(base + ["--bench", f"osvl={held_out}", "--mode", "agentic"]) == 2
    assert "text_search is offline but has no corpus_path (corpus.jsonl): pass --world DIR" in capsys.readouterr().err
    assert main(base + ["--bench", f"osvl={held_out}", "--bench", f"osvl={held_out}", "--mode", "direct"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_scripted_agent_through_the_real_loop_scores_exactly(checkpoint, held_out, world_dir, tokenizer, tmp_path):
    """Half the items answered right after one text_search: Pass@1 must be exactly 50%."""
    import torch

    from osvl.model import from_pretrained

    items = load_benchmark(held_out, "osvl", name="world").items[:N]
    right = {item.question: item.answers[0] for item in items[::2]}
    header = tokenizer.encode("<|im_start|>assistant\n")

    def script(request: GenerationRequest) -> list[int]:
        ids = request.input_ids
        turn = sum(ids[i : i + len(header)] == header for i in range(len(ids))) - 1
        text = tokenizer.decode(ids)
        if turn == 0:
            return tokenizer.encode(
                '<think>look</think><tool_call>{"name": "text_search", "arguments": {"query": "orchid"}}</tool_call>'
            )
        answer = next((a for q, a in right.items() if q in text), "no idea")
        return tokenizer.encode(f"<think>ok</think><response>{answer}</response>")

    engine = ReplayEngine(
        LocalEngine(from_pretrained(checkpoint, dtype=torch.float32), tokenizer, IMAGE_CONFIG), script
    )
    tools = ToolBackendsConfig(
        text_search=TextSearchConfig(corpus_path=str(world_dir / "corpus.jsonl")),
        image_search=ImageSearchConfig(collection_path=str(world_dir / "images.jsonl")),
    )
    registry = default_registry(tools.limits)
    with ToolPool(tools, PoolConfig(num_workers=1, preload=registry.targets())) as pool:
        env = ToolEnvironment(registry, pool)
        renderer = ChatRenderer(
            tokenizer, IMAGE_CONFIG, env.registry.tool_schemas(), system_prompt("agent_system.v1.txt")
        )
        answerer = AgenticAnswerer(
            engine,
            renderer,
            env,
            AgentConfig(
                max_turns=3, max_total_tokens=8192, sampling=SamplingParams(temperature=0.0, max_new_tokens=64)
            ),
        )
        evaluator = Evaluator(answerer, NormalizedMatchJudge(), tmp_path, EvalRunConfig(concurrency=2))
        stats = asyncio.run(evaluator.run(items))
    assert stats.generated == N and stats.max_in_flight <= 2
    records, _ = read_records(tmp_path / "records.jsonl")
    scores = {r["id"]: r["verdict"]["score"] for r in records.values()}
    assert sorted(scores.values()) == [0.0, 0.0, 1.0, 1.0]
    assert all(r["tool_calls"] == 1 and r["finish_reason"] == "response" for r in records.values())
    first = next(iter(records.values()))["trajectory"]["steps"][0]
    assert first["tool_result"]["status"] == "ok" and "world://" in first["tool_result"]["text"]
