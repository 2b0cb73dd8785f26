"""A scripted searcher over the world's tools for the fatal-mode study's tests (importable by spawned runs).

The policy is the real model under forced decoding (``ReplayEngine``): its logprobs are the model's,
so GRPO trains for real, while what it does is fixed by the rollout's seed: answer at once (right or
wrong), search the world once and answer, or keep searching (a cascade once the back-end is down).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from osvl.config import load_recipe
from osvl.data.tokenizer import load_tokenizer
from osvl.model import save_pretrained
from osvl.rl.trajectory import Prompt, write_prompts
from osvl.rollout import LocalEngine, ReplayEngine
from osvl.trainer.policy import build_policy, policy_arch
from tests.trainer.fixtures import write_sft_data

WORDS = ["Dracorland", "Vorka", "Lovor", "Norsaltal", "Jorcor", "amber", "birch", "cobalt", "delta", "ember"]
_WORD = re.compile(r"code word is (\w+)")


def searcher(local: LocalEngine) -> ReplayEngine:
    tok = local.tokenizer

    def script(request):
        text = tok.decode(request.input_ids, skip_special_tokens=False)
        word = _WORD.findall(text)[-1]
        turn = text.count("</tool_call>")
        kind = ((request.sampling.seed or 0) - turn) % 5
        if kind in (3, 4) or (kind == 2 and turn == 0):
            call = {"name": "text_search", "arguments": {"query": f"{word} country"}}
            out = f"<think>look it up</think>\n<tool_call>{json.dumps(call)}</tool_call>"
        else:
            out = f"<think>I know it</think>\n<response>{'wrong' if kind == 1 else word}</response>"
        return tok.encode(out) + [tok.special.im_end]

    return ReplayEngine(local, script)


def study_inputs(root: Path, world: Path) -> dict[str, str]:
    """Tokenizer, a seeded tiny 'SFT' checkpoint and prompt files under ``root``; ``world`` is a built world."""
    tok, _ = write_sft_data(root / "data")
    prompts = [Prompt(id=f"p{i}", question=f"The code word is {w}. What is it?", answer=w) for i, w in enumerate(WORDS)]
    write_prompts(root / "train.jsonl", prompts[:8])
    write_prompts(root / "eval.jsonl", prompts[6:])
    recipe = load_recipe("tiny_grpo", [f"data.tokenizer={tok}", "model.pretrained="])
    tokenizer = load_tokenizer(tok)
    save_pretrained(
        build_policy(recipe, policy_arch(recipe, tokenizer.vocab_size, tokenizer.special), 1),
        root / "sft",
        dtype=torch.float32,
    )
    return {
        "sft": str(root / "sft"),
        "world": str(world),
        "tokenizer": str(tok),
        "prompts": str(root / "train.jsonl"),
        "eval_prompts": str(root / "eval.jsonl"),
    }


TINY = (
    "model.preset=tiny",
    "grpo.max_response_tokens=48",
    "grpo.max_prompt_tokens=512",
    "rollout.max_turns=5",
    "grpo.batch_prompts=4",
    "grpo.mini_batch_prompts=2",
    "grpo.group_size=4",
    "tools.outage_start_turns=2",
)
