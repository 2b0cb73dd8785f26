"""A scripted policy and echo tools for GRPO tests, importable by spawned ranks.

The policy is the real model driven by forced decoding (``ReplayEngine``): the ids are scripted,
the logprobs are the engine model's own, so the importance ratio, masking and the gradient are
real while the mix of outcomes (right, wrong, tool-using, fatal) is known.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

from osvl.rl.trajectory import Prompt
from osvl.rollout import LocalEngine, ReplayEngine
from osvl.synth.records import write_prompts
from osvl.tools import PoolConfig, ToolEnvironment, ToolPool, ToolRegistry, ToolsConfig
from osvl.trainer.tool_env import with_faults
from tests.tools.fault_tools import fault_specs

WORDS = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor"]
_WORD = re.compile(r"code word is (\w+)")


def write_prompts_file(root: Path, n: int = 8) -> Path:
    path = root / "prompts.jsonl"
    if not path.is_file():
        write_prompts(path, [Prompt(id=f"p{i}", question=f"The code word is {WORDS[i]}. What is it?",
                                    answer=WORDS[i]) for i in range(n)])
    return path


def behaviour(seed: int, turn: int) -> int:
    """0 answers, 1 searches then answers, 2 answers wrong, 3 keeps calling a refusing tool (fatal)."""
    return ((seed - turn) % 2**63) % 4


def scripted(local: LocalEngine) -> ReplayEngine:
    return ReplayEngine(local, script_for(local.tokenizer))


def script_for(tok):
    """The scripted policy over ``tok``: what each (prompt, seed, turn) generates."""

    def script(request):
        text = tok.decode(request.input_ids, skip_special_tokens=False)
        turn = text.count("</tool_call>")
        word = _WORD.search(text).group(1)
        kind = behaviour(request.sampling.seed, turn)
        if kind == 3 or (kind == 1 and turn == 0):
            name = "refuse" if kind == 3 else "echo"
            out = f'<think>look it up</think>\n<tool_call>{{"name": "{name}", "arguments": {{"tag": "{word} code"}}}}</tool_call>'
        else:
            out = f"<think>I know it</think>\n<response>{'wrong' if kind == 2 else word}</response>"
        return tok.encode(out) + [tok.special.im_end]

    return script


SLOW_WORD = "ember"  # the gated policy's slow prompt


def gated_script_for(tok):
    """``script_for``, except that every rollout of the slow prompt first calls the gate tool (which
    holds it until the test opens the gate), then answers."""
    plain = script_for(tok)

    def script(request):
        text = tok.decode(request.input_ids, skip_special_tokens=False)
        if _WORD.search(text).group(1) != SLOW_WORD:
            return plain(request)
        if "</tool_call>" not in text:
            call = json.dumps({"name": "gate", "arguments": {"tag": SLOW_WORD}})
            out = f"<think>wait for it</think>\n<tool_call>{call}</tool_call>"
        else:
            out = f"<think>now I know</think>\n<response>{SLOW_WORD}</response>"
        return tok.encode(out) + [tok.special.im_end]

    return script


@contextmanager
def echo_environment(recipe, rank):
    with ToolPool(ToolsConfig(), PoolConfig(num_workers=1, max_queue=16, watch_interval_s=0.02)) as pool:
        yield with_faults(ToolEnvironment(ToolRegistry(fault_specs()), pool), recipe, rank)
