"""The trainer's whole loop on one device: a few SFT steps, then a few GRPO steps whose rollouts, with
tool calls, run through the local engine on the same device, by the stages ``osvl.train`` runs.

    python bench/train_loop.py            # CUDA: the qwen3_vl_8b width cut to 2 decoder layers, random init
    python bench/train_loop.py --smoke    # any machine: the tiny CPU width (tests/bench runs it)

What runs is ``run_sft`` then ``run_grpo`` (the trainer's own functions) on a one-rank process group,
so the policy gets its FSDP2 mixed precision as under ``torchrun``: the policy, AdamW, the local
engine's copy (in the compute dtype) and the fused loss live on the device; the host keeps the data,
the tool workers and the event loop. GRPO starts from the SFT stage's HF export, so the sharded
checkpoint load runs on the device too.

The data is made here (no OpenCV, no world): a BPE tokenizer, expert trajectories that look a code
word up with the ``lookup`` tool and answer it, and the same questions as RL prompts. The rollouts
are steered to known outcomes but generated for real: each turn forces ``<think>``, *samples*
``--think-tokens`` tokens through the engine's batching queue and KV cache, then forces a ``lookup``
call (first turn) or an answer, right when the sampled ids sum to an even number, so rewards vary
within a group and the update has a gradient. Rollout tokens/s counts every token the engine
produced (sampled and forced, both scored by the model).

Writes ``<out-dir>/<name>-<gpu|cpu>-<commit>.json``: the SFT and GRPO step records as the trainer
logged them (step split into rollout / update / weight sync, trainer tokens/s, MFU, peak device
memory), rollout tokens/s per step, and the process's peak host memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: the repo, not bench/ (whose profile.py shadows the stdlib's)
    sys.path[0] = str(REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.kernels.report import device_tag, git_info, result_path, versions, write_record  # noqa: E402

SCHEMA = "osvl.bench.train_loop/1"
WORDS = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel"]
WORDS += ["lagoon", "marble", "nectar", "onyx", "prairie"]
LOOKUP_SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 64}}}


@dataclass(frozen=True)
class LoopConfig:
    preset: str  # the policy's width: a released one (cut to ``layers``) or "tiny"
    layers: int
    param_dtype: str
    sft_steps: int
    grpo_steps: int
    group_size: int
    batch_prompts: int
    think_tokens: int  # sampled per turn
    vocab: int  # the BPE tokenizer's learned vocabulary (Qwen's added tokens come after)


def parse_args(argv: list[str]) -> tuple[LoopConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny width, 2 + 2 steps (any machine)")
    p.add_argument("--preset", default=None, help="default qwen3_vl_8b (tiny with --smoke)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=None, help="default 6 (2 with --smoke)")
    p.add_argument("--grpo-steps", type=int, default=None, help="default 4 (2 with --smoke)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-prompts", type=int, default=4)
    p.add_argument(
        "--think-tokens", type=int, default=None, help="sampled tokens per turn (default 32; 4 with --smoke)"
    )
    p.add_argument("--work-dir", default=None, help="where the data and run directories go (default: a temp dir)")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--name", default="train_loop")
    args = p.parse_args(argv)
    smoke = args.smoke
    config = LoopConfig(
        preset=args.preset or ("tiny" if smoke else "qwen3_vl_8b"),
        layers=args.layers,
        param_dtype="float32" if smoke else "bfloat16",
        sft_steps=args.sft_steps or (2 if smoke else 6),
        grpo_steps=args.grpo_steps or (2 if smoke else 4),
        group_size=args.group_size,
        batch_prompts=args.batch_prompts,
        think_tokens=args.think_tokens or (4 if smoke else 32),
        vocab=512,
    )
    return config, args


# --- the data -----------------------------------------------------------------------------------


def lookup(arguments, images, config):
    """The one tool of the loop (a worker process runs it): what the code word is."""
    from osvl.tools.registry import ToolOutput

    return ToolOutput(text=f"The code word is {arguments.get('word', '')}.")


def _question(word: str) -> str:
    return f"Look up the code word {word} and say it back."


def write_data(root: Path, vocab: int) -> dict[str, Path]:
    """The tokenizer, the SFT trajectories and the RL prompts under ``root``."""
    from osvl.data.tokenizer import train_bpe_tokenizer
    from osvl.rl.trajectory import (
        FinishReason,
        Prompt,
        Step,
        ToolCall,
        ToolResult,
        Trajectory,
        append_jsonl,
        write_prompts,
    )

    root.mkdir(parents=True, exist_ok=True)
    trajectories = []
    for i, word in enumerate(WORDS):
        call = ToolCall("lookup", {"word": word})
        result = ToolResult(status="ok", tool="lookup", text=f"The code word is {word}.")
        body = json.dumps({"name": call.name, "arguments": call.arguments})
        steps = [
            Step(
                [],
                [],
                text=f"<think>look it up</think>\n<tool_call>{body}</tool_call>",
                tool_call=call,
                tool_result=result,
                observation_text=result.text,
            ),
            Step([], [], text=f"<think>found it</think>\n<response>{word}</response>", response=word),
        ]
        prompt = Prompt(id=f"q{i}", question=_question(word), answer=word)
        trajectories.append(Trajectory(prompt, steps, FinishReason.RESPONSE, group_id=i, sample_index=0))
    corpus = [s.text for t in trajectories for s in t.steps] + [t.prompt.question for t in trajectories]
    train_bpe_tokenizer(corpus * 4, vocab_size=vocab).save(root / "tokenizer.json")
    append_jsonl(root / "sft.jsonl", trajectories)
    write_prompts(root / "prompts.jsonl", [t.prompt for t in trajectories])
    return {"tokenizer": root / "tokenizer.json", "sft": root / "sft.jsonl", "prompts": root / "prompts.jsonl"}


@contextlib.contextmanager
def lookup_environment(recipe, rank):
    """The GRPO stage's tools: ``lookup`` in a worker pool (what ``tools.backend`` builds for the world)."""
    from osvl.tools import PoolConfig, ToolBackendsConfig, ToolEnvironment, ToolPool, ToolRegistry, ToolSpec

    spec = ToolSpec("lookup", "look a code word up", LOOKUP_SCHEMA, target="bench.train_loop:lookup", deadline_s=30.0)
    registry = ToolRegistry([spec])
    config = PoolConfig(num_workers=2, max_queue=64, preload=registry.targets())
    with ToolPool(ToolBackendsConfig(), config) as pool:
        yield ToolEnvironment(registry, pool)


class SteeredSampling:
    """Real sampling steered to known outcomes (the module docstring): the local engine samples
    ``think_tokens`` per turn between forced openings and endings, all scored by the model."""

    def __init__(self, local, think_tokens: int) -> None:
        self.local, self.think_tokens = local, think_tokens

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    def load_weights(self, state_dict, version: int) -> None:
        self.local.load_weights(state_dict, version)

    async def _forced(self, context, images, ids, temperature: float) -> list[float]:
        from osvl.rollout import GenerationRequest

        return await asyncio.to_thread(self.local.score, GenerationRequest(context, images), ids, temperature)

    async def generate(self, request):
        from osvl.rollout import GenerationRequest, GenerationResult, StopKind

        tok, sampling = self.local.tokenizer, request.sampling
        text = tok.decode(request.input_ids, skip_special_tokens=False)
        word = next(w for w in WORDS if _question(w) in text)
        context, opening = list(request.input_ids), tok.encode("<think>")
        opening_lp = await self._forced(context, request.images, opening, sampling.temperature)
        free = replace(sampling, max_new_tokens=self.think_tokens, stop=(), stop_token_ids=())
        thought = await self.local.generate(GenerationRequest(context + opening, request.images, free))
        if "</tool_call>" not in text:
            call = json.dumps({"name": "lookup", "arguments": {"word": word}})
            ending = f"</think>\n<tool_call>{call}</tool_call>"
        else:
            ending = f"</think>\n<response>{word if sum(thought.token_ids) % 2 == 0 else 'unknown'}</response>"
        closing = tok.encode(ending) + [tok.special.im_end]
        closing_lp = await self._forced(
            context + opening + thought.token_ids, request.images, closing, sampling.temperature
        )
        return GenerationResult(
            opening + thought.token_ids + closing,
            opening_lp + thought.logprobs + closing_lp,
            StopKind.STOP,
            thought.policy_version,
            len(context),
        )


# --- the run ------------------------------------------------------------------------------------


def recipes(config: LoopConfig, data: dict[str, Path], work: Path):
    """The SFT recipe and the GRPO recipe (from the SFT export) of the loop."""
    from osvl.config import load_recipe

    common = [
        f"model.preset={config.preset}",
        f"model.layers={config.layers}",
        f"parallel.param_dtype={config.param_dtype}",
        "parallel.dp_shard=-1",
        f"data.tokenizer={data['tokenizer']}",
        "data.max_tokens=4096",
        "metrics.log_every=1",
        "metrics.tensorboard=false",
        "checkpoint.every_steps=0",
        f"checkpoint.export_dtype={config.param_dtype}",
    ]
    sft = load_recipe(
        "tiny_sft",
        [
            *common,
            f"job.run_dir={work / 'sft'}",
            f"data.train_path={data['sft']}",
            f"sft.max_steps={config.sft_steps}",
            "sft.global_batch=4",
            "optimizer.lr=1e-4",
        ],
    )
    grpo = load_recipe(
        "tiny_grpo",
        [
            *common,
            f"job.run_dir={work / 'grpo'}",
            f"model.pretrained={work / 'sft' / 'hf'}",
            f"data.train_path={data['prompts']}",
            f"grpo.max_steps={config.grpo_steps}",
            f"grpo.group_size={config.group_size}",
            f"grpo.batch_prompts={config.batch_prompts}",
            f"grpo.mini_batch_prompts={config.batch_prompts}",
            f"grpo.max_response_tokens={config.think_tokens + 64}",
            "rollout.max_turns=3",
            f"rollout.max_in_flight={config.group_size * config.batch_prompts}",
            "tools.fault_rate=0.0",
            "judges.accuracy=exact",
        ],
    )
    return sft, grpo


def one_rank_group() -> None:
    """A one-rank process group, so the trainer applies its FSDP2 plan (mixed precision) as under torchrun."""
    from osvl.parallel import use_host_device
    from osvl.parallel._compat import default_backend

    use_host_device()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29_500 + os.getpid() % 1000))
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(default_backend(), rank=0, world_size=1)


def rollout_tokens(run_dir: Path) -> dict[int, int]:
    """Tokens the engine produced in each GRPO step, from the recorded rollouts."""
    from osvl.rl.trajectory import read_jsonl

    out = {}
    for path in sorted((run_dir / "rollouts").glob("rollouts_step*.jsonl")):
        step = int(path.stem.removeprefix("rollouts_step"))
        out[step] = sum(len(s.token_ids) for t in read_jsonl(path) for s in t.steps)
    return out


def summary(sft: list[dict], grpo: list[dict], tokens: dict[int, int]) -> dict:
    """Means over the steps after the first (the first compiles the kernels and warms the caches)."""

    def mean(records: list[dict], key: str) -> float | None:
        values = [r[key] for r in records[1:] if key in r] or [r[key] for r in records if key in r]
        return sum(values) / len(values) if values else None

    for r in grpo:
        r["rollout_tokens"] = tokens.get(int(r["step"]), 0)
        r["rollout_tokens_per_s"] = r["rollout_tokens"] / max(r["time_rollout_s"], 1e-9)
    return {
        "sft_step_time_s": mean(sft, "step_time_s"),
        "sft_tokens_per_s": mean(sft, "tokens_per_s"),
        "sft_mfu": mean(sft, "mfu"),
        "grpo_step_time_s": mean(grpo, "step_time_s"),
        "grpo_time_rollout_s": mean(grpo, "time_rollout_s"),
        "grpo_time_update_s": mean(grpo, "time_train_s"),
        "grpo_time_sync_s": mean(grpo, "time_sync_s"),
        "grpo_rollout_tokens_per_s": mean(grpo, "rollout_tokens_per_s"),
        "grpo_trainer_tokens_per_s": mean(grpo, "tokens_per_s"),
        "grpo_mfu": mean(grpo, "mfu"),
        "peak_device_gib": max((r.get("memory_peak_gib", 0.0) for r in sft + grpo), default=0.0),
        "grpo_tool_calls_mean": mean(grpo, "tool_calls_mean"),
        "grpo_accuracy": mean(grpo, "accuracy"),
    }


def run(config: LoopConfig, out_dir: Path, name: str, work: Path) -> tuple[dict, Path]:
    from osvl.trainer import run_grpo, run_sft
    from osvl.trainer.metrics import read_metrics

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {
        "schema": SCHEMA,
        "name": name,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_info(REPO),
        "device": {"type": device.type, "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"},
        "versions": versions(),
        "config": asdict(config),
        "complete": False,
    }
    path = result_path(out_dir, name, device_tag(device), record["git"]["short"])
    write_record(record, path)
    data = write_data(work / "data", config.vocab)
    sft_recipe, grpo_recipe = recipes(config, data, work)
    one_rank_group()
    try:
        started = time.perf_counter()
        run_sft(sft_recipe)
        record["sft_seconds"] = time.perf_counter() - started
        started = time.perf_counter()
        steered = lambda local: SteeredSampling(local, config.think_tokens)  # noqa: E731
        run_grpo(grpo_recipe, environment=lookup_environment, engine_wrapper=steered)
        record["grpo_seconds"] = time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    record["sft_steps"] = read_metrics(sft_recipe.job.run_dir)
    record["grpo_steps"] = read_metrics(grpo_recipe.job.run_dir)
    record["summary"] = summary(
        record["sft_steps"], record["grpo_steps"], rollout_tokens(Path(grpo_recipe.job.run_dir))
    )
    record["summary"]["peak_host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    record["complete"] = True
    write_record(record, path)
    return record, path


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="osvl_train_loop_") as scratch:
        work = Path(args.work_dir) if args.work_dir else Path(scratch)
        record, path = run(config, Path(args.out_dir), args.name, work)
    print(json.dumps(record["summary"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
