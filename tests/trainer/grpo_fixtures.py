"""A scripted policy and echo tools for GRPO tests, importable by spawned ranks.

The policy is the real model driven by forced decoding (``ReplayEngine``): the ids are scripted,
the logprobs are the engine model's own, so the importance ratio, masking and the gradient are
real while the mix of outcomes (right, wrong, tool-using, fatal) is known.
"""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from osvl.rl.trajectory import Prompt, write_prompts
from osvl.rollout import GenerationRequest, GenerationResult, LocalEngine, ReplayEngine, StopKind
from osvl.tools import PoolConfig, ToolBackendsConfig, ToolEnvironment, ToolPool, ToolRegistry
from osvl.trainer.tool_env import with_faults
from tests.tools.fault_tools import fault_specs

WORDS = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor"]
_WORD = re.compile(r"code word is (\w+)")


def write_prompts_file(root: Path, n: int = 8) -> Path:
    path = root / "prompts.jsonl"
    if not path.is_file():
        write_prompts(
            path,
            [
                Prompt(id=f"p{i}", question=f"The code word is {WORDS[i]}. What is it?", answer=WORDS[i])
                for i in range(n)
            ],
        )
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
            call = json.dumps({"name": name, "arguments": {"tag": f"{word} code"}})
            out = f"<think>look it up</think>\n<tool_call>{call}</tool_call>"
        else:
            out = f"<think>I know it</think>\n<response>{'wrong' if kind == 2 else word}</response>"
        return tok.encode(out) + [tok.special.im_end]

    return script


class SampledThoughts:
    """Real sampling through the local engine's batching queue, steered to known outcomes.

    Each turn forces ``<think>``, then *samples* ``think_tokens`` free tokens (batched with whatever
    else is in flight), then forces an answer that is right when the sampled ids sum to an even
    number. So the rewards, the advantages and the update all depend on what the batched engine
    sampled and on its logprobs, which is what the deterministic mode must make reproducible.
    """

    def __init__(self, local: LocalEngine, think_tokens: int = 6) -> None:
        self.local, self.think_tokens = local, think_tokens

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    def load_weights(self, state_dict, version: int) -> None:
        self.local.load_weights(state_dict, version)

    async def _forced(self, context: list[int], images, ids: list[int], temperature: float) -> list[float]:
        return await asyncio.to_thread(self.local.score, GenerationRequest(context, images), ids, temperature)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        tok, s = self.local.tokenizer, request.sampling
        word = _WORD.search(tok.decode(request.input_ids, skip_special_tokens=False)).group(1)
        context, opening = list(request.input_ids), tok.encode("<think>")
        opening_lp = await self._forced(context, request.images, opening, s.temperature)
        free = replace(s, max_new_tokens=self.think_tokens, stop=(), stop_token_ids=())
        thought = await self.local.generate(GenerationRequest(context + opening, request.images, free))
        answer = word if sum(thought.token_ids) % 2 == 0 else "wrong"
        closing = tok.encode(f"</think>\n<response>{answer}</response>") + [tok.special.im_end]
        closing_lp = await self._forced(context + opening + thought.token_ids, request.images, closing, s.temperature)
        return GenerationResult(
            opening + thought.token_ids + closing,
            opening_lp + thought.logprobs + closing_lp,
            StopKind.STOP,
            thought.policy_version,
            len(context),
        )


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
    registry = ToolRegistry(fault_specs())
    config = PoolConfig(num_workers=1, max_queue=16, watch_interval_s=0.02, preload=registry.targets())
    with ToolPool(ToolBackendsConfig(), config) as pool:
        yield with_faults(ToolEnvironment(registry, pool), recipe, rank)
