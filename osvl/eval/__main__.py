"""``python -m osvl.eval``: Pass@1 of a checkpoint or a running engine on benchmark files.

    python -m osvl.eval --checkpoint ckpt/ --bench simplevqa=simplevqa.jsonl --bench infoseek=val.jsonl \\
        --images-root infoseek=oven_images/ --mode agentic --world world/ --out runs/eval \\
        [--concurrency 8] [--judge-url https://api.openai.com/v1 --judge-model gpt-4o]

``--bench NAME=FILE`` reads FILE with the loader called NAME (see ``osvl.eval.benchmarks``);
``LABEL:NAME=FILE`` runs it under another label. Re-running with the same ``--out`` resumes:
judged items are skipped, unjudged ones are re-judged, failed generations are redone.
Writes ``records.jsonl``, ``summary.json`` and ``table.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from osvl.eval.benchmarks import FORMATS, BenchmarkFormat, LoadReport, get_format, load_benchmark
from osvl.eval.judge import DEFAULT_PROMPT, AnswerJudge, EquivalenceJudge, NormalizedMatchJudge
from osvl.eval.modes import MODES, AgenticAnswerer, Answerer, DirectAnswerer, RagAnswerer, system_prompt
from osvl.eval.runner import RECORDS, Evaluator, RunConfig, read_records
from osvl.eval.summary import cost_table, pass_table, summarize_benchmark, summary_dict


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
    src.add_argument("--checkpoint", help="HF-layout checkpoint dir (config.json, safetensors, tokenizer.json, "
                                          "preprocessor_config.json), run by the local engine")
    src.add_argument("--engine", action="append", help="SGLang server (or router) base URL; repeatable")
    p.add_argument("--tokenizer", help="tokenizer.json or dir with it and preprocessor_config.json (with --engine)")
    p.add_argument("--bench", action="append", required=True, metavar="[LABEL:]NAME=FILE",
                   help=f"benchmark file; NAME one of: {', '.join(FORMATS)}")
    p.add_argument("--images-root", action="append", default=[], metavar="LABEL=DIR",
                   help="where a benchmark's relative image paths / image ids live (default: the file's dir)")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--world", help="world dir for the offline tool backends (rag and agentic modes)")
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


def _tokenizer_and_images(path: Path):
    from osvl.data.image import ImageConfig
    from osvl.data.tokenizer import load_tokenizer

    directory = path if path.is_dir() else path.parent
    config_file = directory / "preprocessor_config.json"
    if not config_file.is_file():
        raise ValueError(f"no preprocessor_config.json in {directory}")
    return load_tokenizer(path), ImageConfig.from_preprocessor_config(json.loads(config_file.read_text()))


def build_engine(args: argparse.Namespace):
    if args.checkpoint:
        import torch

        from osvl.model import from_pretrained
        from osvl.rollout.local_engine import LocalEngine

        tokenizer, image_config = _tokenizer_and_images(Path(args.checkpoint))
        model = from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype))
        return LocalEngine(model, tokenizer, image_config, max_batch=args.concurrency), tokenizer, image_config
    from osvl.rollout.sglang import SGLangConfig, SGLangEngine

    if not args.tokenizer:
        raise ValueError("--engine needs --tokenizer (the renderer tokenizes prompts on this side)")
    tokenizer, image_config = _tokenizer_and_images(Path(args.tokenizer))
    return SGLangEngine(SGLangConfig(urls=tuple(args.engine))), tokenizer, image_config


def build_judge(args: argparse.Namespace) -> AnswerJudge:
    if not args.judge_url:
        return NormalizedMatchJudge()
    from osvl.rl.judges import ChatCompletionsClient, ChatJudgeConfig

    config = ChatJudgeConfig(base_url=args.judge_url, model=args.judge_model,
                             api_key=os.environ.get(args.judge_key_env), timeout_s=args.judge_timeout_s,
                             max_attempts=args.judge_attempts)
    return EquivalenceJudge(ChatCompletionsClient(config), args.judge_prompt)


@contextlib.contextmanager
def tool_environment(world: str | None, mode: str) -> Iterator[object | None]:
    if mode == "direct":
        yield None
        return
    if not world:
        raise ValueError(f"--mode {mode} needs --world DIR for the offline tool backends")
    from osvl.tools import ImageSearchConfig, PoolConfig, TextSearchConfig, ToolEnvironment, ToolPool, ToolsConfig
    from osvl.tools import default_registry

    root = Path(world)
    for name in ("corpus.jsonl", "images.jsonl"):
        if not (root / name).is_file():
            raise ValueError(f"--world {root} has no {name}")
    config = ToolsConfig(text_search=TextSearchConfig(corpus_path=str(root / "corpus.jsonl")),
                         image_search=ImageSearchConfig(collection_path=str(root / "images.jsonl")))
    with ToolPool(config, PoolConfig(num_workers=2)) as pool:
        yield ToolEnvironment(default_registry(config.limits), pool)


def build_answerer(args: argparse.Namespace, engine, tokenizer, image_config, env) -> Answerer:
    from osvl.data.chat import ChatRenderer
    from osvl.rollout.agent import AgentConfig
    from osvl.rollout.engine import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    if args.mode == "agentic":
        renderer = ChatRenderer(tokenizer, image_config, env.registry.tool_schemas(),
                                system_prompt("agent_system.v1.txt"))
        config = AgentConfig(max_turns=args.max_turns, max_total_tokens=args.max_total_tokens, sampling=sampling)
        return AgenticAnswerer(engine, renderer, env, config)
    renderer = ChatRenderer(tokenizer, image_config, (), system_prompt("direct_system.v1.txt"))
    if args.mode == "rag":
        return RagAnswerer(engine, renderer, sampling, env)
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
            report.items = report.items[:args.limit]
        reports.append((report, get_format(fmt)))
    return reports


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_summary(out: Path, reports: Sequence[tuple[LoadReport, BenchmarkFormat]], args: argparse.Namespace, judge: AnswerJudge,
                  stats) -> str:
    records, _ = read_records(out / RECORDS)
    summaries = []
    for report, fmt in reports:
        mine = [records[item.key] for item in report.items if item.key in records]
        summaries.append(summarize_benchmark(report.benchmark, fmt.column, mine, sum(report.rejected.values())))
    source = args.checkpoint or ",".join(args.engine)
    label = f"osvl ({args.mode}, {Path(source).name or source}; judge {judge.name})"
    table = "\n\n".join([f"# Pass@1 (%) — {args.mode}", pass_table(summaries, args.mode, label),
                         "## Counts and cost", cost_table(summaries)])
    (out / "table.md").write_text(table + "\n", encoding="utf-8")
    summary = summary_dict(summaries, mode=args.mode, source=source, judge=judge.name, git_commit=git_commit(),
                           run={"generated": stats.generated, "rejudged": stats.rejudged, "skipped": stats.skipped,
                                "wall_s": stats.wall_s, "max_in_flight": stats.max_in_flight,
                                "corrupt_record_lines": stats.corrupt_lines},
                           loading=[r.to_dict() for r, _ in reports])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        RunConfig(args.concurrency, args.judge_concurrency, args.seed)
        reports = load_all(args)
        judge = build_judge(args)
        engine, tokenizer, image_config = build_engine(args)
        out = Path(args.out)
        with tool_environment(args.world, args.mode) as env:
            answerer = build_answerer(args, engine, tokenizer, image_config, env)
            evaluator = Evaluator(answerer, judge, out, RunConfig(args.concurrency, args.judge_concurrency, args.seed))
            stats = asyncio.run(evaluator.run([item for r, _ in reports for item in r.items]))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(write_summary(out, reports, args, judge, stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
