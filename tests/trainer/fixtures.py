"""Tiny SFT corpus written to disk the way osvl.synth writes it: text steps, no engine ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.rl.trajectory import (
    FinishReason,
    Prompt,
    Step,
    ToolCall,
    ToolResult,
    Trajectory,
    append_jsonl,
)

CITIES = ["Inverness", "Oslo", "Lyon", "Porto", "Graz", "Turku", "Gent", "Bergen"]
YEARS = ["1982", "1875", "1931", "1904", "1967", "1899", "1950", "1923"]


def trajectory(i: int, with_image: bool) -> Trajectory:
    city, year = CITIES[i % len(CITIES)], YEARS[i % len(YEARS)]
    call = ToolCall("text_search", {"query": f"bridge {city} opened"})
    body = json.dumps({"name": call.name, "arguments": call.arguments})
    result = ToolResult(status="ok", tool="text_search", text=f"The bridge in {city} opened in {year}.")
    steps = [
        Step(
            token_ids=[],
            logprobs=[],
            text=f"<think>search {city}</think>\n<tool_call>{body}</tool_call>",
            tool_call=call,
            tool_result=result,
            observation_text=result.text,
        ),
        Step(token_ids=[], logprobs=[], text=f"<think>found it</think>\n<response>{year}</response>", response=year),
    ]
    images = [np.random.default_rng(i).integers(0, 256, (32, 40, 3), dtype=np.uint8)] if with_image else []
    prompt = Prompt(id=f"q{i}", question=f"When did the bridge in {city} open?", images=images, answer=year)
    return Trajectory(prompt=prompt, steps=steps, finish_reason=FinishReason.RESPONSE, group_id=i, sample_index=0)


def write_sft_data(root: Path, n: int = 8) -> tuple[Path, Path]:
    """Writes ``tokenizer.json`` and ``sft.jsonl`` under ``root``; returns both paths."""
    if (root / "sft.jsonl").is_file():
        return root / "tokenizer.json", root / "sft.jsonl"
    root.mkdir(parents=True, exist_ok=True)
    trajectories = [trajectory(i, with_image=i % 2 == 0) for i in range(n)]
    corpus = [s.text for t in trajectories for s in t.steps] + [t.prompt.question for t in trajectories]
    corpus += [s.observation_text for t in trajectories for s in t.steps]
    tokenizer = train_bpe_tokenizer(corpus * 4, vocab_size=384)
    tokenizer.save(root / "tokenizer.json")
    append_jsonl(root / "sft.jsonl", trajectories)
    return root / "tokenizer.json", root / "sft.jsonl"


def sft_overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    tok, data = write_sft_data(root)
    return [f"data.tokenizer={tok}", f"data.train_path={data}", f"job.run_dir={run_dir}", *extra]
