"""``python -m osvl.eval``: Pass@1 of a checkpoint or a running engine on benchmark files.

    python -m osvl.eval --checkpoint ckpt/ --bench simplevqa=simplevqa.jsonl --bench infoseek=val.jsonl \\
        --images-root infoseek=oven_images/ --mode agentic --world world/ --out runs/eval \\
        [--concurrency 8] [--judge-url https://api.openai.com/v1 --judge-model gpt-4o]

    # a released checkpoint against the live web, with the tool schema and system prompt it was trained on
    SERPER_API_KEY=... JINA_API_KEY=... python -m osvl.eval --checkpoint OpenSearch-VL-8B/ \\
        --bench fvqa=fvqa_test.parquet --mode agentic --tools online --tool-profile release \\
        --system-prompt my_prompt.txt --out runs/fvqa

The system turn: a checkpoint osvl exported is shown the system prompt and tool schema it was
trained with (read from its chat template; ``--tool-profile`` defaults to the profile of those
tools); ``--system-prompt FILE`` replaces the prompt (an empty file: none). Other checkpoints get
the mode's shipped prompt and, in agentic mode, the offered tools' schema.
``--bench NAME=FILE`` reads FILE with the loader called NAME (see ``osvl.eval.benchmarks``);
``LABEL:NAME=FILE`` runs it under another label. Re-running with the same ``--out`` resumes:
judged items are skipped, unjudged ones are re-judged, failed generations are redone.
Writes ``records.jsonl``, ``summary.json`` and ``table.md`` to ``--out``. Tool back-ends: see
``osvl.eval.tools`` (API keys only through environment variables named by ``*-key-env`` flags or
``*_key_env`` fields); checkpoint directories: see ``osvl.eval.model_dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from osvl.data.chat import system_text
from osvl.eval.benchmarks import (
    FORMATS,
    BenchmarkFormat,
    LoadReport,
    get_format,
    load_benchmark,
)
from osvl.eval.judge import (
    DEFAULT_PROMPT,
    AnswerJudge,
    EquivalenceJudge,
    NormalizedMatchJudge,
)
from osvl.eval.model_dir import ModelDir, load_model_dir
from osvl.eval.modes import (
    MODES,
    AgenticAnswerer,
    Answerer,
    DirectAnswerer,
    RagAnswerer,
    system_prompt,
)
from osvl.eval.runner import RECORDS, EvalRunConfig, Evaluator, read_records
from osvl.eval.summary import cost_table, pass_table, summarize_benchmark, summary_dict
from osvl.eval.tools import (
    FLAG_FIELDS,
    EvalToolEnvironment,
    check_offline_paths,
    tool_sections,
)
from osvl.tools.config import ToolBackendsConfig
from osvl.tools.config_file import resolve_sections
from osvl.tools.profiles import PROFILES, tool_profile

SHIPPED_PROMPTS = {"direct": "direct_system.v1.txt", "rag": "direct_system.v1.txt", "agentic": "agent_system.v1.txt"}


def parse_bench(spec: str) -> tuple[str, str, Path]:
    """``NAME=FILE`` or ``LABEL:NAME=FILE`` -> (label, format name, file)."""
    name, sep, file = spec.partition("=")
    if not sep or not name or not file:
        raise ValueError(f"--bench expects NAME=FILE or LABEL:NAME=FILE, got {spec!r}")
    label, _, fmt = name.rpartition(":")
    get_format(fmt)
    return label or fmt, fmt, Path(file)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m osvl.eval", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint",
        help="HF-layout checkpoint dir (config.json, safetensors, tokenizer.json, "
        "preprocessor_config.json), run by the local engine",
    )
    src.add_argument("--engine", action="append", help="SGLang server (or router) base URL; repeatable")
    p.add_argument("--tokenizer", help="tokenizer.json or dir with it and preprocessor_config.json (with --engine)")
    p.add_argument(
        "--bench",
        action="append",
        required=True,
        metavar="[LABEL:]NAME=FILE",
        help=f"benchmark file; NAME one of: {', '.join(FORMATS)}",
    )
    p.add_argument(
        "--images-root",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="where a benchmark's relative image paths / image ids live (default: the file's dir)",
    )
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--world", help="world dir for the offline tool backends (rag and agentic modes)")
    tools = p.add_argument_group("tools (rag and agentic modes)")
    tools.add_argument(
        "--tools",
        metavar="NAME|FILE.toml",
        help="tool back-end config: a path, or a shipped one by name (online); flags below override it",
    )
    tools.add_argument(
        "--tool-profile",
        choices=PROFILES,
        help="tool schema the model sees: osvl's (paper) or the OpenSearch-VL release's names; "
        "default: the profile an osvl-exported checkpoint was trained with, else paper",
    )
    tools.add_argument("--python-interpreter", action="store_true", help="offer the sandboxed python_interpreter")
    tools.add_argument(
        "--python-sandbox",
        choices=("namespaces", "sandbox_fusion", "unsafe_no_boundary"),
        default="namespaces",
        help="the boundary python_interpreter runs behind (unsafe_no_boundary: none, only a Python audit hook)",
    )
    tools.add_argument(
        "--sandbox-fusion-url", default="", help="SandboxFusion base URL for --python-sandbox sandbox_fusion"
    )
    tools.add_argument("--text-search-backend", choices=("offline", "online"))
    tools.add_argument("--serper-url")
    tools.add_argument("--serper-key-env", metavar="VAR", help="environment variable holding the Serper key")
    tools.add_argument("--jina-url")
    tools.add_argument("--jina-key-env", metavar="VAR", help="environment variable holding the Jina Reader key")
    tools.add_argument("--summarizer-url", help="OpenAI-compatible base URL of the page summarizer")
    tools.add_argument("--summarizer-model")
    tools.add_argument("--summarizer-key-env", metavar="VAR")
    tools.add_argument("--image-search-backend", choices=("offline", "online"))
    tools.add_argument("--image-search-url", help="reverse-image search API URL")
    tools.add_argument("--image-search-key-env", metavar="VAR")
    tools.add_argument("--image-upload-url", help="image host for reverse-image search by URL")
    p.add_argument(
        "--system-prompt",
        metavar="FILE",
        help="system prompt replacing the checkpoint's own (an osvl export's) or the mode's shipped one "
        "(a released checkpoint's own prompt); an empty file means no system prompt",
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--judge-url", help="OpenAI-compatible base URL; default: the offline normalized-match judge")
    p.add_argument("--judge-model", default="gpt-4o")
    p.add_argument("--judge-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    p.add_argument("--judge-prompt", default=DEFAULT_PROMPT)
    p.add_argument("--judge-concurrency", type=int, default=8)
    p.add_argument("--judge-timeout-s", type=float, default=60.0)
    p.add_argument("--judge-attempts", type=int, default=5)
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--limit", type=int, help="first N items of each benchmark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    return p


def read_model_dir(args: argparse.Namespace) -> ModelDir:
    """The checkpoint directory (``--checkpoint``) or the tokenizer directory of ``--engine`` runs."""
    if args.checkpoint:
        return load_model_dir(args.checkpoint)
    if not args.tokenizer:
        raise ValueError("--engine needs --tokenizer (the renderer tokenizes prompts on this side)")
    return load_model_dir(args.tokenizer, require_config=False)


def build_engine(args: argparse.Namespace, model_dir: ModelDir) -> object:
    if args.checkpoint:
        import torch

        from osvl.model import from_pretrained
        from osvl.rollout.local_engine import LocalEngine

        model = from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype))
        return LocalEngine(model, model_dir.tokenizer, model_dir.image_config, max_batch=args.concurrency)
    from osvl.rollout.sglang import SGLangConfig, SGLangEngine

    return SGLangEngine(SGLangConfig(urls=tuple(args.engine)))


def build_judge(args: argparse.Namespace) -> AnswerJudge:
    if not args.judge_url:
        return NormalizedMatchJudge()
    from osvl.rl.chat_client import ChatCompletionsClient, ChatJudgeConfig

    config = ChatJudgeConfig(
        base_url=args.judge_url,
        model=args.judge_model,
        api_key=os.environ.get(args.judge_key_env),
        timeout_s=args.judge_timeout_s,
        max_attempts=args.judge_attempts,
    )
    return EquivalenceJudge(ChatCompletionsClient(config), args.judge_prompt)


def tools_config(args: argparse.Namespace) -> ToolBackendsConfig:
    """The validated tool back-ends of the run: ``--tools`` file, flags on top, ``--world`` defaults."""
    config = resolve_sections(
        tool_sections(args.tools, {dest: getattr(args, dest) for dest in FLAG_FIELDS}, args.world)
    )
    check_offline_paths(config)
    return config


@contextlib.contextmanager
def tool_environment(args: argparse.Namespace) -> Iterator[EvalToolEnvironment | None]:
    """Worker pool over the configured back-ends, seen through the ``--tool-profile`` schema."""
    if args.mode == "direct":
        yield None
        return
    from osvl.tools import PoolConfig, ToolEnvironment, ToolPool, tool_profile
    from osvl.tools.sandbox import SandboxConfig, SandboxUnavailable, check_sandbox

    config = tools_config(args)
    try:
        sandbox = SandboxConfig(backend=args.python_sandbox, fusion_url=args.sandbox_fusion_url)
        if args.python_interpreter:
            check_sandbox(sandbox)
    except (ValueError, SandboxUnavailable) as err:
        raise SystemExit(f"--python-sandbox: {err}") from None
    profile = tool_profile(
        args.tool_profile, config.limits, python_interpreter=args.python_interpreter, sandbox=sandbox
    )
    with ToolPool(config, PoolConfig(num_workers=2, preload=profile.registry.targets())) as pool:
        yield EvalToolEnvironment(ToolEnvironment(profile.registry, pool), profile)


def read_system_prompt(path: str | None) -> str | None:
    """The ``--system-prompt`` file's text (``""`` for an empty file: no system prompt); None without it."""
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--system-prompt file not found: {file}")
    return file.read_text(encoding="utf-8").strip()


@dataclass(frozen=True)
class SystemTurn:
    """What the evaluated model's system turn shows, and where its prompt came from."""

    prompt: str
    tools: list[dict[str, Any]]
    source: Literal["checkpoint", "file", "shipped"]


def system_turn(
    mode: str, model_dir: ModelDir, prompt_file: str | None, offered: Sequence[dict[str, Any]]
) -> SystemTurn:
    """An osvl export's own prompt and shown tool schema (none when its profile showed none), the
    prompt replaced by ``prompt_file`` if given; other checkpoints get the mode's shipped prompt and,
    in agentic mode, the ``offered`` tools' schema."""
    given = read_system_prompt(prompt_file)
    trained = model_dir.trained_prompt
    if given is not None:
        prompt, source = given, "file"
    elif trained is not None:
        prompt, source = trained[0], "checkpoint"
    else:
        prompt, source = system_prompt(SHIPPED_PROMPTS[mode]), "shipped"
    if mode != "agentic":
        tools = []
    else:
        tools = list(trained[1]) if trained is not None else list(offered)
    return SystemTurn(prompt, tools, source)


def resolve_tool_profile(requested: str | None, model_dir: ModelDir, python_interpreter: bool) -> str:
    """``--tool-profile``, else the profile offering the tools an osvl export was trained to call, else paper."""
    trained = model_dir.trained_prompt
    names = {tool["function"]["name"] for tool in trained[1]} if trained is not None else set()

    def missing(profile: str) -> set[str]:
        offered = tool_profile(profile, python_interpreter=python_interpreter).tool_schemas()
        return names - {tool["function"]["name"] for tool in offered}

    if requested is not None:
        if missing(requested):
            raise ValueError(
                f"--tool-profile {requested} does not offer {sorted(missing(requested))}, tools the "
                f"checkpoint was trained to call (its chat template shows them)"
            )
        return requested
    matching = [profile for profile in PROFILES if not missing(profile)]
    if not matching:
        raise ValueError(
            f"the checkpoint was trained with tools {sorted(names)} (its chat template shows them), "
            f"which no tool profile ({', '.join(PROFILES)}) offers"
        )
    return matching[0]


def build_answerer(
    args: argparse.Namespace,
    engine,
    model_dir: ModelDir,
    env: EvalToolEnvironment | None,
    turn: SystemTurn | None = None,
) -> Answerer:
    from osvl.data.chat import ChatRenderer
    from osvl.rollout.agent import AgentConfig
    from osvl.rollout.engine import SamplingParams

    tokenizer, image_config = model_dir.tokenizer, model_dir.image_config
    sampling = SamplingParams(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, stop_token_ids=model_dir.stop_token_ids
    )
    if turn is None:
        turn = system_turn(args.mode, model_dir, args.system_prompt, env.tool_schemas() if env is not None else [])
    renderer = ChatRenderer(tokenizer, image_config, turn.tools, turn.prompt)
    if args.mode == "agentic":
        config = AgentConfig(max_turns=args.max_turns, max_total_tokens=args.max_total_tokens, sampling=sampling)
        return AgenticAnswerer(engine, renderer, env, config)
    if args.mode == "rag":
        return RagAnswerer(engine, renderer, sampling, env.env)
    return DirectAnswerer(engine, renderer, sampling)


def load_all(args: argparse.Namespace) -> list[tuple[LoadReport, BenchmarkFormat]]:
    roots = {}
    for spec in args.images_root:
        label, sep, directory = spec.partition("=")
        if not sep:
            raise ValueError(f"--images-root expects LABEL=DIR, got {spec!r}")
        roots[label] = directory
    reports: list[tuple[LoadReport, BenchmarkFormat]] = []
    for label, fmt, file in (parse_bench(spec) for spec in args.bench):
        if any(r.benchmark == label for r, _ in reports):
            raise ValueError(f"benchmark label {label!r} given twice; use LABEL:NAME=FILE to tell them apart")
        report = load_benchmark(file, fmt, roots.get(label), name=label)
        if args.limit is not None:
            report.items = report.items[: args.limit]
        reports.append((report, get_format(fmt)))
    return reports


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_summary(
    out: Path,
    reports: Sequence[tuple[LoadReport, BenchmarkFormat]],
    args: argparse.Namespace,
    judge: AnswerJudge,
    stats,
    turn: SystemTurn,
) -> str:
    records, _ = read_records(out / RECORDS)
    summaries = []
    for report, fmt in reports:
        mine = [records[item.key] for item in report.items if item.key in records]
        summaries.append(summarize_benchmark(report.benchmark, fmt.column, mine, sum(report.rejected.values())))
    source = args.checkpoint or ",".join(args.engine)
    label = f"osvl ({args.mode}, {Path(source).name or source}; judge {judge.name})"
    table = "\n\n".join(
        [
            f"# Pass@1 (%) — {args.mode}",
            pass_table(summaries, args.mode, label),
            "## Counts and cost",
            cost_table(summaries),
        ]
    )
    (out / "table.md").write_text(table + "\n", encoding="utf-8")
    system = system_text(turn.tools, turn.prompt)
    summary = summary_dict(
        summaries,
        mode=args.mode,
        source=source,
        judge=judge.name,
        git_commit=git_commit(),
        tool_profile=args.tool_profile if args.mode != "direct" else None,
        system_prompt_source=turn.source,
        system_tools=[t["function"]["name"] for t in turn.tools],
        system_turn_sha256=hashlib.sha256(system.encode()).hexdigest() if system else None,
        run={
            "generated": stats.generated,
            "rejudged": stats.rejudged,
            "skipped": stats.skipped,
            "wall_s": stats.wall_s,
            "max_in_flight": stats.max_in_flight,
            "corrupt_record_lines": stats.corrupt_lines,
        },
        loading=[r.to_dict() for r, _ in reports],
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        EvalRunConfig(args.concurrency, args.judge_concurrency, args.seed)
        reports = load_all(args)
        judge = build_judge(args)
        if args.mode != "direct":
            tools_config(args)  # a bad tool config fails before the model is loaded
        read_system_prompt(args.system_prompt)
        model_dir = read_model_dir(args)
        args.tool_profile = resolve_tool_profile(args.tool_profile, model_dir, args.python_interpreter)
        engine = build_engine(args, model_dir)
        out = Path(args.out)
        with tool_environment(args) as env:
            turn = system_turn(args.mode, model_dir, args.system_prompt, env.tool_schemas() if env is not None else [])
            answerer = build_answerer(args, engine, model_dir, env, turn)
            run_config = EvalRunConfig(args.concurrency, args.judge_concurrency, args.seed)
            evaluator = Evaluator(answerer, judge, out, run_config)
            stats = asyncio.run(evaluator.run([item for r, _ in reports for item in r.items]))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(write_summary(out, reports, args, judge, stats, turn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
