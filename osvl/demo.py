"""``make demo`` helpers: the demo tokenizer, the evaluation's command line (the evaluation itself is
:mod:`osvl.trainer.evaluation`), the no-tool prior and the before/after summary.

``python -m osvl.demo tokenizer --data DIR``   byte-level BPE over the curated set
``python -m osvl.demo evaluate --recipe tiny_grpo --checkpoint DIR|init --out FILE [--samples K] [--faults]``
    greedy Pass@1 on a prompt file (the recipe's data.train_path), rendered and tool-served exactly as in
    GRPO, no faults (``--faults``: the recipe's injected ones, as in training); `grounded`: answers stated
    word for word by one of the rollout's observations;
    `chains`: at which lookup chain questions stopped following their evidence; each prompt's result is
    kept for paired comparisons; ``--samples K``: K rollouts a prompt at the GRPO temperature instead, for
    pass@k; ``--rollouts F``: every rollout as JSONL, to read what the policy did
``python -m osvl.demo prior --recipe tiny_grpo --sft FILE --out FILE``
    the no-tool floor: the SFT data's most frequent answer to each prompt's asked attribute
``python -m osvl.demo summary --sft DIR --grpo DIR --evals init=FILE sft=FILE grpo=FILE [--sampled sft=FILE ...]``
    [--phases FILE --started FILE]``: the stages compared, then where the demo's time went
``python -m osvl.demo seeds --run seed0=SFT_FILE,GRPO_FILE seed1=...``
    seeds of the whole recipe: each seed's SFT -> GRPO difference and the mean over seeds
``python -m osvl.demo timed --log FILE --phase NAME -- COMMAND...``
    runs COMMAND and appends its wall seconds to FILE under NAME (``make demo``'s per-phase times)

The fatal-mode ablation (paper Table 3b) that starts from the demo's checkpoint is
``osvl.study`` (``make ablation``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imports stay light: the tool workers `evaluate` spawns re-import this module as __main__
    from osvl.rl.trajectory import Prompt

# GRPO's per-step metrics the summary compares first vs last: the rollouts' reward and accuracy, the
# share of answers read from a tool observation, the share of groups that carry a gradient (any reward
# spread / right and wrong answers), the fatal rule
SUMMARY_KEYS = (
    "reward",
    "accuracy",
    "grounded",
    "signal_groups",
    "accuracy_signal_groups",
    "fatal_rate",
    "clamped_frac",
)


def demo_tokenizer(
    data_dir: str | Path,
    vocab_size: int = 2048,
    text: str | Path | None = None,
    text_docs: int = 0,
    out: str | Path | None = None,
    max_digits: int = 1,
    entity_worlds: Sequence[str | Path] = (),
) -> Path:
    """Trains a tokenizer (default ``data_dir/tokenizer.json``) on the SFT trajectories and RL
    questions it will encode, plus the first ``text_docs`` (0 = all) documents of a plain-text file;
    ``max_digits``: see :func:`osvl.data.tokenizer.train_bpe_tokenizer`; the entity titles of
    ``entity_worlds`` become one id each (a closed world's names, copied as one id each)."""
    from osvl.data.formats import iter_text
    from osvl.data.tokenizer import train_bpe_tokenizer
    from osvl.jsonl import iter_jsonl
    from osvl.rl.trajectory import read_prompts, trajectory_from_dict
    from osvl.world.build import load_world

    data = Path(data_dir)
    sft, rl = data / "sft" / "trajectories.jsonl", data / "rl" / "prompts.jsonl"
    for path in (sft, rl):
        if not path.is_file():
            raise ValueError(f"{path} is missing: run `python -m osvl.synth run --out {data}` first")
    if text_docs < 0:
        raise ValueError(f"text_docs must be >= 0, got {text_docs}")
    corpus = []
    if text is not None:
        documents = iter_text(text)
        corpus += list(itertools.islice(documents, text_docs) if text_docs else documents)
    for traj in (trajectory_from_dict(data, store=None) for _, data in iter_jsonl(sft)):  # text only, no pixels
        corpus.append(traj.prompt.question)
        corpus += [s.text for s in traj.steps] + [s.observation_text for s in traj.steps if s.observation_text]
    corpus += [p.question for p in read_prompts(rl)]
    target = Path(out) if out is not None else data / "tokenizer.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    titles = [page.title for world in entity_worlds for page in load_world(world).graph.entities()]
    train_bpe_tokenizer(corpus, vocab_size=vocab_size, max_digits=max_digits, whole_words=titles).save(target)
    return target


_ASKED = re.compile(r"(?:What is|In what year is) the (.+?) of ")


def answer_prior(sft_path: str | Path, prompts: Sequence[Prompt]) -> dict[str, float | int]:
    """Accuracy of answering each prompt with no tools at all, by the SFT data's most frequent
    answer to the same asked attribute (or overall, when the question names none): the floor a
    policy's accuracy must clear before it shows that it used what its tools returned."""
    from osvl.jsonl import iter_jsonl
    from osvl.rl.offline_judges import ExactMatchAccuracyJudge

    def asked(question: str) -> str:
        match = _ASKED.match(question)
        return match.group(1) if match else ""

    answers: dict[str, Counter] = {}
    for line, row in iter_jsonl(sft_path):  # only the prompts: decoding every step's images takes ~20 s
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, dict) or not {"question", "answer"} <= prompt.keys():
            raise ValueError(f"{sft_path}:{line}: not a trajectory record (no prompt question and answer)")
        answers.setdefault(asked(prompt["question"]), Counter())[prompt["answer"]] += 1
    if not answers:
        raise ValueError(f"{sft_path} holds no trajectories")
    overall = sum(answers.values(), Counter()).most_common(1)[0][0]
    judge = ExactMatchAccuracyJudge()
    hits = 0.0
    for prompt in prompts:
        counts = answers.get(asked(prompt.question))
        hits += judge.judge_answer(prompt, counts.most_common(1)[0][0] if counts else overall).score
    return {"accuracy": hits / max(len(prompts), 1), "prompts": len(prompts)}


def _window_mean(records: list[dict], key: str, first: bool, width: int) -> float:
    chosen = records[:width] if first else records[-width:]
    values = [r[key] for r in chosen if key in r]
    if not values:
        raise ValueError(f"metrics have no {key!r}")
    return sum(values) / len(values)


def accuracy_interval(result: dict) -> tuple[float, float]:
    """95% Wilson interval of an evaluation's accuracy over its scored prompts."""
    from osvl.eval.interval import wilson_interval

    return wilson_interval(result["accuracy"] * result["scored"], result["scored"])


def _eval_row(label: str, result: dict) -> str:
    low, high = accuracy_interval(result)
    return (
        f"  {label:<5} accuracy {result['accuracy']:.3f} [{low:.3f}, {high:.3f}]  reward {result['reward']:.3f}  "
        f"format {result['reward_fmt']:.3f}  answered {result['answered']:.3f}  "
        f"grounded {result['grounded']:.3f}  "
        f"fatal {result['fatal_rate']:.3f}  turns {result['turns_mean']:.1f}  (n={result['scored']})"
    )


def _chain_row(label: str, result: dict) -> str | None:
    """Where the rollouts' lookup chains broke (``chains`` of ``evaluate``), or None without chain questions."""
    chains = result.get("chains")
    if not chains or not chains["rollouts"]:
        return None
    broken = ", ".join(f"lookup {at}: {count}" for at, count in chains["broken_at"].items()) or "none"
    return (
        f"  {label:<5} followed its evidence through every lookup in {chains['complete']}/{chains['rollouts']} "
        f"rollouts; first lookup missed: {broken}"
    )


def _paired_row(before: tuple[str, dict], after: tuple[str, dict]) -> str:
    """``after - before`` on the same prompts with its paired bootstrap interval over prompts and, where the
    evaluations name each prompt's anchor entity, over anchors (the verdict then follows the anchors: questions
    about one entity are not independent draws), or why there is none."""
    from osvl.eval.interval import clustered_paired_difference, paired_difference

    (first, a), (last, b) = before, after
    if "per_prompt" not in a or "per_prompt" not in b:
        return f"  {last} - {first}: no per-prompt results to pair (evaluations written before they were kept)"
    try:
        diff = paired_difference(b["per_prompt"], a["per_prompt"])
    except ValueError as error:
        return f"  {last} - {first}: not compared ({error})"
    row = (
        f"  {last} - {first}: {diff.value:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]  (95% paired bootstrap over "
        f"{len(b['per_prompt'])} prompts)"
    )
    anchors = {**a.get("anchors", {}), **b.get("anchors", {})}
    if anchors and set(b["per_prompt"]) <= set(anchors):
        diff = clustered_paired_difference(b["per_prompt"], a["per_prompt"], anchors)
        row += f", [{diff.low:+.3f}, {diff.high:+.3f}] over {len(set(anchors.values()))} anchors"
    verdict = "higher" if diff.low > 0 else "lower" if diff.high < 0 else "not distinguishable"
    return row + f": {last} is {verdict}" + (" from" if verdict == "not distinguishable" else " than") + f" {first}"


def _hops_row(label: str, result: dict) -> str | None:
    """Greedy accuracy by the questions' hop count, or None where the evaluation names no hops."""
    hops, per_prompt = result.get("hops"), result.get("per_prompt")
    if not hops or not per_prompt:
        return None
    right: Counter[int] = Counter()
    asked: Counter[int] = Counter()
    for prompt, accuracy in per_prompt.items():
        if prompt in hops and accuracy is not None:
            asked[hops[prompt]] += 1
            right[hops[prompt]] += accuracy >= 0.5
    counts = ", ".join(f"{n} hop{'s' if n > 1 else ''} {right[n]}/{asked[n]}" for n in sorted(asked))
    return f"  {label:<5} right by hops: {counts}"


def _sampled_row(label: str, result: dict) -> str:
    passes = "  ".join(f"pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items())
    return (
        f"  {label:<5} {passes}  (n={result['prompts']} prompts x {result['samples']} samples at temperature "
        f"{result['temperature']:g}, top-p {result['top_p']:g})"
    )


def _room_row(label: str, greedy: dict, sampled: dict) -> str:
    from osvl.eval.interval import sharpening_room

    room = sharpening_room(greedy["per_prompt"], sampled["per_prompt"])
    return (
        f"  {label:<5} greedy misses {room.greedy_wrong}/{room.prompts}, {room.wrong_sampled_right} of them answered "
        f"by at least one of its {sampled['samples']} samples; {room.right_sampled_minority} of its "
        f"{room.greedy_right} greedy answers given by fewer than half"
    )


def _faults_said(results: Sequence[tuple[str, dict]]) -> str:
    """The tool faults the compared evaluations ran under; they must be the same for a paired comparison."""
    settings = {json.dumps(result.get("tool_faults", {"fault_rate": 0.0, "outage_rate": 0.0})) for _, result in results}
    if len(settings) > 1:
        raise ValueError(
            f"the evaluations ran under different tool faults ({', '.join(sorted(settings))}): not comparable"
        )
    faults = json.loads(settings.pop())
    if not faults["fault_rate"] and not faults["outage_rate"]:
        return "no faults"
    return f"tool faults as in training: {faults['fault_rate']:g} of calls, outages {faults['outage_rate']:g}"


def _compared(results: Sequence[tuple[str, dict]]) -> list[str]:
    """Greedy evaluations of the stages on the same prompts and faults: each with its interval, where its
    chains broke, and each stage against the one before, paired by prompt."""
    lines = [
        f"greedy Pass@1 on the evaluation prompts (GRPO's prompt, tools and turn budget; {_faults_said(results)}):"
    ]
    lines += [_eval_row(label, result) for label, result in results]
    lines += [row for label, result in results if (row := _chain_row(label, result)) is not None]
    lines += [row for label, result in results if (row := _hops_row(label, result)) is not None]
    return lines + [_paired_row(before, after) for before, after in itertools.pairwise(results)]


def summary_lines(
    sft_dir: str | Path,
    grpo_dir: str | Path,
    width: int = 1,
    evals: Sequence[tuple[str, str | Path]] = (),
    other_evals: Sequence[tuple[str, str | Path]] = (),
    prior: str | Path | None = None,
    sampled: Sequence[tuple[str, str | Path]] = (),
    faulted: Sequence[tuple[str, str | Path]] = (),
) -> list[str]:
    """Held-out greedy evaluations (``evals``: label, JSON from ``evaluate``) at each stage, each with
    its 95% Wilson interval, each stage against the one before it by the paired bootstrap (paired by
    prompt: the stages answered the same questions), and the last against the no-tool answer ``prior``
    (JSON from ``prior``) when given; pass@k of sampled evaluations (``sampled``, from ``evaluate
    --samples k``: does GRPO sharpen what the policy could already do, or widen it?), and for a stage
    evaluated both ways its room for sharpening (:func:`osvl.eval.interval.sharpening_room`); ``faulted``: the
    same comparison for evaluations with the training environment's tool faults (``evaluate --faults``:
    does the policy recover from a failed call?); ``other_evals``
    (other prompt sets) reported beside them; then GRPO's rollout metrics: first ``width`` steps vs
    last ``width``."""
    from osvl.trainer.metrics import read_metrics

    sft, grpo = read_metrics(sft_dir), read_metrics(grpo_dir)
    lines = []
    results = [(label, json.loads(Path(path).read_text())) for label, path in evals]
    if results:
        lines += _compared(results)
        if prior is not None:
            last = results[-1]
            floor = json.loads(Path(prior).read_text())["accuracy"]
            verdict = "above" if last[1]["accuracy"] > floor else "NOT above"
            low, high = accuracy_interval(last[1])
            where = "inside" if low <= floor <= high else "outside"
            lines.append(
                f"  no-tool answer prior (the SFT data's most frequent answer to the asked attribute): "
                f"accuracy {floor:.3f}; {last[0]} is {verdict} it (the prior is {where} {last[0]}'s 95% "
                f"interval)"
            )
    if faulted:
        lines += _compared([(label, json.loads(Path(path).read_text())) for label, path in faulted])
    if sampled:
        samples = [(label, json.loads(Path(path).read_text())) for label, path in sampled]
        lines.append("pass@k: the share of prompts that k samples answer at least once (unbiased estimate):")
        lines += [_sampled_row(label, result) for label, result in samples]
        greedy = dict(results)
        paired = [(label, greedy[label], result) for label, result in samples if label in greedy]
        if paired:
            lines.append("room for sharpening: greedy misses that a sample answers, per stage:")
            lines += [_room_row(*triple) for triple in paired]
    if other_evals:
        lines.append("the same greedy evaluation on other prompt sets (reported, not compared):")
        lines += [_eval_row(label, json.loads(Path(path).read_text())) for label, path in other_evals]
    lines.append(f"SFT : {len(sft)} steps, loss {sft[0]['loss']:.3f} -> {sft[-1]['loss']:.3f}  ({sft_dir})")
    lines.append(f"GRPO: {len(grpo)} steps  ({grpo_dir})")
    for key in SUMMARY_KEYS:
        if any(key in r for r in grpo):
            before, after = _window_mean(grpo, key, True, width), _window_mean(grpo, key, False, width)
            lines.append(f"  {key:<22} before {before:.3f}  after {after:.3f}")
    acc_before, acc_after = _window_mean(grpo, "accuracy", True, width), _window_mean(grpo, "accuracy", False, width)
    verdict = "improved" if acc_after > acc_before else "did NOT improve"
    lines.append(f"  rollout accuracy {verdict} over GRPO ({acc_before:.3f} -> {acc_after:.3f})")
    lines.append(f"plots: {Path(sft_dir) / 'plots'}  {Path(grpo_dir) / 'plots'}")
    return lines


SEED_GAIN_BAR = 0.10  # what each seed's GRPO - SFT should reach in the demo's seed table (docs/demo.md)


def seed_lines(runs: Sequence[tuple[str, str | Path, str | Path]]) -> list[str]:
    """Seeds of the whole recipe (label, the SFT policy's evaluation, its GRPO policy's evaluation), all on the
    same prompts: each seed's SFT and GRPO accuracy and paired difference, over prompts and, where the
    evaluations name anchors, over anchor entities; then the mean difference over seeds with its bootstrap
    over seeds and anchors (or prompts), and whether every seed clears the bar."""
    from osvl.eval.interval import clustered_paired_difference

    loaded = [(name, json.loads(Path(b).read_text()), json.loads(Path(a).read_text())) for name, b, a in runs]
    if not loaded:
        raise ValueError("no seeds to compare")
    missing = [name for name, b, a in loaded if "per_prompt" not in b or "per_prompt" not in a]
    if missing:
        raise ValueError(f"evaluations without per-prompt results cannot be paired: {', '.join(missing)}")
    prompts = set(loaded[0][1]["per_prompt"])
    for name, b, a in loaded:
        if set(b["per_prompt"]) != prompts or set(a["per_prompt"]) != prompts:
            raise ValueError(f"{name} was evaluated on other prompts than {loaded[0][0]}")
    anchors = {p: e for _, b, a in loaded for result in (b, a) for p, e in result.get("anchors", {}).items()}
    clusters, over = (anchors, "anchors") if prompts <= set(anchors) else ({p: p for p in prompts}, "prompts")
    groups = len(set(clusters.values()))
    lines = [f"{len(loaded)} seeds of the whole recipe on {len(prompts)} prompts ({groups} {over}):"]
    diffs = []
    for name, before, after in loaded:
        by_prompt = clustered_paired_difference(after["per_prompt"], before["per_prompt"], {p: p for p in prompts})
        diff = clustered_paired_difference(after["per_prompt"], before["per_prompt"], clusters)
        diffs.append(diff)
        lines.append(
            f"  {name}: sft {before['accuracy']:.3f}  grpo {after['accuracy']:.3f}  grpo - sft {diff.value:+.3f} "
            f"[{by_prompt.low:+.3f}, {by_prompt.high:+.3f}] over prompts"
            + (f", [{diff.low:+.3f}, {diff.high:+.3f}] over anchors" if over == "anchors" else "")
        )
    pooled = clustered_paired_difference(
        [a["per_prompt"] for _, _, a in loaded], [b["per_prompt"] for _, b, _ in loaded], clusters
    )
    cleared = sum(d.value >= SEED_GAIN_BAR and d.low > 0 for d in diffs)
    lines.append(
        f"  mean over seeds: {pooled.value:+.3f} [{pooled.low:+.3f}, {pooled.high:+.3f}] (95% bootstrap over seeds and "
        f"{over}); {cleared} of {len(diffs)} seeds gain >= {SEED_GAIN_BAR:+.2f} with an interval clear of zero; "
        f"the weakest seed's lower bound is {min(d.low for d in diffs):+.3f}"
    )
    return lines


def _run_triples(specs: Sequence[str]) -> list[tuple[str, str, str]]:
    triples = []
    for label, paths in _labelled(specs, "--run"):
        before, sep, after = paths.partition(",")
        if not sep or not before or not after:
            raise ValueError(f"--run takes LABEL=SFT_EVAL,GRPO_EVAL, got {label}={paths}")
        triples.append((label, before, after))
    return triples


def timed_phase(log: str | Path, phase: str, command: Sequence[str]) -> int:
    """Runs ``command`` (its output straight through) and appends ``{"phase", "seconds", "returncode"}`` to ``log``;
    returns its exit status."""
    import subprocess

    if not command:
        raise ValueError("timed needs a command after --")
    started = time.monotonic()
    returncode = subprocess.call(list(command))
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        record = {"phase": phase, "seconds": round(time.monotonic() - started, 3), "returncode": returncode}
        handle.write(json.dumps(record) + "\n")
    return returncode


def phase_lines(log: str | Path, started: str | Path | None = None) -> list[str]:
    """Wall seconds per phase of :func:`timed_phase`'s ``log`` (phases in first-run order, repeats summed) and,
    with ``started`` (a file holding the Unix time the job began), the total since then and what the phases
    leave out (installs, the shell)."""
    seconds: dict[str, float] = {}
    for line in Path(log).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        seconds[record["phase"]] = seconds.get(record["phase"], 0.0) + record["seconds"]
    phases = "  ".join(f"{name} {value:.0f}" for name, value in seconds.items())
    lines = [f"seconds by phase: {phases}  (phases {sum(seconds.values()):.0f})"]
    if started is not None:
        total = time.time() - float(Path(started).read_text(encoding="utf-8").split()[0])
        lines.append(f"since the job started: {total:.0f} s ({total - sum(seconds.values()):.0f} s outside the phases)")
    return lines


def _labelled(specs: Sequence[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label:
            raise ValueError(f"{flag} takes LABEL=FILE, got {spec!r}")
        pairs.append((label, path))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.demo")
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenizer")
    tok.add_argument("--data", required=True)
    tok.add_argument("--vocab-size", type=int, default=2048)
    tok.add_argument("--text", help='plain-text JSONL ({"text": ...}) whose documents join the corpus')
    tok.add_argument("--text-docs", type=int, default=0, help="use only the first N documents of --text (0 = all)")
    tok.add_argument("--out", help="where to write tokenizer.json (default: DATA/tokenizer.json)")
    tok.add_argument(
        "--max-digits", type=int, default=1, choices=(1, 2, 3), help="digits per number piece (1: Qwen's single digits)"
    )
    tok.add_argument(
        "--entity-world", action="append", default=[], help="a world whose entity titles become one id each"
    )
    ev = sub.add_parser("evaluate")
    ev.add_argument("--recipe", required=True)
    ev.add_argument("--checkpoint", required=True, help="HF directory, or 'init' for the seeded initialization")
    ev.add_argument("--out", required=True)
    ev.add_argument("--limit", type=int, default=0)
    ev.add_argument(
        "--samples", type=int, default=0, help="k rollouts a prompt at the GRPO temperature (pass@k) instead of greedy"
    )
    ev.add_argument(
        "--rollouts", help="also write every rollout (JSONL, replaced; images in images/ beside it) to read what it did"
    )
    ev.add_argument(
        "--faults",
        action="store_true",
        help="with the recipe's injected tool faults and outages, as in training (default: off)",
    )
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    summ = sub.add_parser("summary")
    summ.add_argument("--sft", required=True)
    summ.add_argument("--grpo", required=True)
    summ.add_argument("--window", type=int, default=1)
    summ.add_argument("--evals", nargs="*", default=[], metavar="LABEL=FILE")
    summ.add_argument(
        "--other-evals",
        nargs="*",
        default=[],
        metavar="LABEL=FILE",
        help="evaluations on other prompt sets, listed after the verdict",
    )
    summ.add_argument("--prior", help="JSON from the prior command: the no-tool accuracy floor")
    summ.add_argument(
        "--sampled", nargs="*", default=[], metavar="LABEL=FILE", help="evaluations with --samples k: their pass@k"
    )
    summ.add_argument("--phases", help="the per-phase log of timed: where the job's time went, printed last")
    summ.add_argument("--started", help="a file holding the Unix time the job began (with --phases)")
    summ.add_argument(
        "--faulted",
        nargs="*",
        default=[],
        metavar="LABEL=FILE",
        help="evaluations with --faults, compared stage by stage as --evals are",
    )
    seeds = sub.add_parser("seeds", help="seeds of the whole recipe: each SFT policy against its GRPO policy")
    seeds.add_argument(
        "--run", nargs="+", required=True, metavar="LABEL=SFT_EVAL,GRPO_EVAL", help="each seed's two evaluations"
    )
    timed = sub.add_parser("timed", help="run a command and log its wall seconds under a phase name")
    timed.add_argument("--log", required=True)
    timed.add_argument("--phase", required=True)
    timed.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    pri = sub.add_parser("prior", help="accuracy of the SFT data's most frequent answer per asked attribute, no tools")
    pri.add_argument("--recipe", required=True)
    pri.add_argument("--sft", required=True, help="the SFT trajectories JSONL")
    pri.add_argument("--out", required=True)
    pri.add_argument("--limit", type=int, default=0)
    pri.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        if args.command == "tokenizer":
            print(
                demo_tokenizer(
                    args.data,
                    args.vocab_size,
                    args.text,
                    args.text_docs,
                    args.out,
                    args.max_digits,
                    args.entity_world,
                )
            )
        elif args.command == "evaluate":
            from osvl.config.loader import load_recipe
            from osvl.trainer.evaluation import evaluate_policy

            recipe = load_recipe(args.recipe, args.set)
            result = evaluate_policy(
                recipe, args.checkpoint, args.limit, samples=args.samples, rollouts=args.rollouts, faults=args.faults
            )
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            per_prompt = ("per_prompt", "anchors", "hops")  # in the file; one line here
            print(json.dumps({k: v for k, v in result.items() if k not in per_prompt} | {"out": args.out}))
        elif args.command == "summary":
            evals, others = _labelled(args.evals, "--evals"), _labelled(args.other_evals, "--other-evals")
            sampled, faulted = _labelled(args.sampled, "--sampled"), _labelled(args.faulted, "--faulted")
            lines = summary_lines(args.sft, args.grpo, args.window, evals, others, args.prior, sampled, faulted)
            if args.phases:
                lines += phase_lines(args.phases, args.started)
            print("\n".join(lines))
        elif args.command == "seeds":
            print("\n".join(seed_lines(_run_triples(args.run))))
        elif args.command == "timed":
            return timed_phase(args.log, args.phase, args.argv[1:] if args.argv[:1] == ["--"] else args.argv)
        elif args.command == "prior":
            from osvl.config.loader import load_recipe
            from osvl.trainer.grpo_data import load_prompts

            prompts = load_prompts(load_recipe(args.recipe, args.set).data)
            result = answer_prior(args.sft, prompts[: args.limit] if args.limit else prompts)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            print(json.dumps(result))
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
