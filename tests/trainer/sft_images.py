"""An SFT corpus whose trajectories share images (prompt and tool images, some unique, one recorded
observation), written the way osvl.synth writes it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from osvl.data.chat import ChatRenderer
from osvl.data.image import ImageConfig
from osvl.data.tokenizer import train_bpe_tokenizer
from osvl.jsonl import iter_jsonl
from osvl.rl.trajectory import FinishReason, Prompt, Step, ToolCall, ToolResult, Trajectory, append_jsonl

IMAGE_CONFIG = ImageConfig(patch_size=8, min_pixels=1024, max_pixels=16384)
SHARED_SIZES = [(40, 56), (64, 64), (30, 90)]


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _trajectory(i: int, shared: list[np.ndarray]) -> Trajectory:
    """Prompt images: a shared one (none every fourth), plus a unique one every fifth; the crop
    returns a shared image on even lines, a unique one on odd lines; line 9 ends on the crop."""
    crop_image = shared[(i + 1) % 3] if i % 2 == 0 else _image(24 + i, 80 - 2 * i, seed=100 + i)
    search = ToolCall("text_search", {"query": f"museum {i}"})
    crop = ToolCall("crop", {"box": [0, 0, 8 + i, 8]})
    steps = [
        Step(
            token_ids=[],
            logprobs=[],
            text=f"<think>look up {i}</think>\n<tool_call>{json.dumps(search.arguments)}</tool_call>",
            tool_call=search,
            tool_result=ToolResult(status="ok", tool="text_search", text=f"page {i}"),
            observation_text=f"The museum {i} opened in {1900 + i}.",
        ),
        Step(
            token_ids=[],
            logprobs=[],
            text=f"<think>zoom in {i}</think>\n<tool_call>crop</tool_call>",
            tool_call=crop,
            tool_result=ToolResult(status="ok", tool="crop", images=[crop_image]),
            observation_images=[crop_image],
        ),
        Step(token_ids=[], logprobs=[], text=f"<response>{1900 + i}</response>", response=str(1900 + i)),
    ]
    images = ([shared[i % 3]] if i % 4 != 3 else []) + ([_image(50, 30 + i, seed=200 + i)] if i % 5 == 0 else [])
    prompt = Prompt(id=f"q{i}", question=f"When did museum {i} open?", images=images, answer=str(1900 + i))
    finish = FinishReason.MAX_TURNS if i == 9 else FinishReason.RESPONSE  # line 9's crop is never rendered
    return Trajectory(
        prompt=prompt, steps=steps[:2] if i == 9 else steps, finish_reason=finish, group_id=i, sample_index=0
    )


def write_image_sft_data(root: Path, n: int = 16) -> Path:
    """``tokenizer.json`` and ``sft.jsonl`` (plus its image store) under ``root``; line 7 carries the
    engine's ids and the agent loop's recorded observation, with its image's pad run."""
    shared = [_image(h, w, seed=k) for k, (h, w) in enumerate(SHARED_SIZES)]
    trajectories = [_trajectory(i, shared) for i in range(n)]
    corpus = [s.text for t in trajectories for s in t.steps] + [
        s.observation_text for t in trajectories for s in t.steps
    ]
    tokenizer = train_bpe_tokenizer([*corpus, *(t.prompt.question for t in trajectories)] * 4, vocab_size=384)
    tokenizer.save(root / "tokenizer.json")
    recorded = trajectories[7]
    for step in recorded.steps:
        step.token_ids = [*tokenizer.encode(step.text), tokenizer.special.im_end]
        step.logprobs = [-0.25] * len(step.token_ids)
    renderer = ChatRenderer(tokenizer, IMAGE_CONFIG)
    recorded.steps[1].observation_token_ids = renderer.render_observation(recorded.steps[1]).ids
    append_jsonl(root / "sft.jsonl", trajectories)
    return root / "sft.jsonl"


def rendered_image_files(data: Path, lines: set[int]) -> set[str]:
    """Content hashes of the images the renderer puts in those lines' sequences (the last step's
    observation follows no generation, so it is not rendered)."""
    records = [record for _, record in iter_jsonl(data)]
    return {
        sha
        for i in lines
        for sha in records[i]["prompt"]["images"]
        + [h for step in records[i]["steps"][:-1] for h in step["observation_images"]]
    }
