"""Tables, intervals and plots of the fatal-mode study (``python -m osvl.study report``).

Reads what the study's finished runs wrote (``eval.jsonl``: one greedy rollout per held-out prompt;
``metrics.jsonl`` and ``rollouts/``: the training steps) and renders: the paper's Table 3b layout
(accuracy per mode at each outage rate, the change against vanilla GRPO), tool use (tool calls per
answer, answers given without any tool, answers stated by an observation), the error-counting
choices, the one-sided clamp's bookkeeping next to the paper's Figure 5, and accuracy and tool use
against the training step. Every interval is the two-level bootstrap of
:func:`osvl.eval.interval.bootstrap_interval` over prompts and seeds; differences against vanilla
are paired by prompt and seed. The markdown goes between the ``<!-- ablation:begin -->`` and
``<!-- ablation:end -->`` markers of ``--doc`` (the hand-written reading around them stays).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from osvl.eval.interval import Estimate, bootstrap_interval
from osvl.jsonl import iter_jsonl
from osvl.rl.advantages import MODES, AdvantageConfig, compute_advantages
from osvl.rl.stats import batch_stats
from osvl.study.mechanism import ToyAgent, push_markdown, push_table
from osvl.study.power import Power, pilot_power, power_markdown, read_power, save_power
from osvl.study.rows import ACCURACY, CALLS, GROUNDED, LOOKUPS, MAIN_CHOICE, TOOL_USE, Metric, StudyRows, load_rows
from osvl.study.runs import DONE, SFT_RUN, StudyConfig, plan, run_dir

BEGIN, END = "<!-- ablation:begin -->", "<!-- ablation:end -->"
MECHANISM = ("<!-- mechanism:begin -->", "<!-- mechanism:end -->")
POWER = ("<!-- power:begin -->", "<!-- power:end -->")
LABELS = {
    "vanilla": "+ Vanilla GRPO",
    "hard_mask": "+ GRPO w/ Hard Masking",
    "fatal_mask": "+ GRPO w/ Fatal Masking only",
    "fatal_clamp": "+ Fatal Masking + One-sided Clamp",
}
PAPER_TABLE_3B = {"sft": 64.6, "vanilla": 67.6, "hard_mask": 67.7, "fatal_mask": 69.1, "fatal_clamp": 71.8}
PAPER_FIGURE_5 = {"zeroed": 0.918, "preserved": 0.082, "mean_zeroed": -0.68, "mean_preserved": 0.57}
# The paper's Table 3b ordering, pair by pair, and its end to end: (lower, higher, strict)
ORDERINGS = (
    ("vanilla", "hard_mask", False),
    ("hard_mask", "fatal_mask", True),
    ("fatal_mask", "fatal_clamp", True),
    ("vanilla", "fatal_clamp", True),
)


def _fmt(estimate: Estimate | None, signed: bool = False, digits: int = 3) -> str:
    if estimate is None or math.isnan(estimate.value):
        return "–"
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    interval = "" if math.isnan(estimate.low) else f" [{f.format(estimate.low)}, {f.format(estimate.high)}]"
    return f.format(estimate.value) + interval


def _estimate(rows: StudyRows, key, metric: Metric, baseline_key=None) -> Estimate | None:
    table = rows.table(key, metric)
    if table is None:
        return None
    if baseline_key is None:
        return bootstrap_interval(table, clusters=rows.clusters)
    baseline = rows.table(baseline_key, metric)
    return None if baseline is None else bootstrap_interval(table, baseline, clusters=rows.clusters)


def table_3b(rows: StudyRows, rates: Sequence[float]) -> str:
    """Accuracy per mode and outage rate with the change against vanilla GRPO, in the paper's layout."""
    head = "| Method | " + " | ".join(f"accuracy, outage {r:g} | Δ vs vanilla" for r in rates) + " | paper Avg. |"
    lines = [head, "|---|" + "---:|---:|" * len(rates) + "---:|"]
    sft = _estimate(rows, None, ACCURACY)
    lines.append("| SFT only | " + " | ".join(f"{_fmt(sft)} | –" for _ in rates) + f" | {PAPER_TABLE_3B['sft']} |")
    for mode in MODES:
        cells = []
        for rate in rates:
            key, base = (rate, MAIN_CHOICE, mode), (rate, MAIN_CHOICE, "vanilla")
            delta = None if mode == "vanilla" else _estimate(rows, key, ACCURACY, base)
            seeds = rows.seeds(key)
            cells.append(f"{_fmt(_estimate(rows, key, ACCURACY))} ({seeds} seeds) | {_fmt(delta, signed=True)}")
        lines.append(f"| {LABELS[mode]} | " + " | ".join(cells) + f" | {PAPER_TABLE_3B[mode]} |")
    return "\n".join(lines)


def _verdict(delta: Estimate, strict: bool) -> str:
    if delta.low > 0.0:
        return "shown"
    if delta.high < 0.0:
        return "**reversed**"
    return "undetermined" if strict else "not reversed (the interval holds zero)"


def orderings_table(rows: StudyRows, rates: Sequence[float], power: Power | None) -> str:
    """Each pairwise step of the paper's ordering (vanilla <= hard < fatal < clamp, and clamp against vanilla)
    at each outage rate: the paired difference and whether the study shows it, reverses it or cannot tell,
    next to the smallest difference it could detect (the pilot's, fixed before the runs)."""
    resolution = "–" if power is None else f"{power.detectable:.3f}"
    lines = [
        "| outage | ordering (paper) | Δ accuracy, higher - lower | verdict | detectable at 80% power |",
        "|---:|---|---:|---|---:|",
    ]
    for rate in rates:
        for lower, higher, strict in ORDERINGS:
            delta = _estimate(rows, (rate, MAIN_CHOICE, higher), ACCURACY, (rate, MAIN_CHOICE, lower))
            if delta is None:
                continue
            sign = "<" if strict else "<="
            verdict = _verdict(delta, strict) if math.isfinite(delta.low) else "–"
            lines.append(
                f"| {rate:g} | {lower} {sign} {higher} | {_fmt(delta, signed=True)} | {verdict} | {resolution} |"
            )
    return "\n".join(lines)


def mechanism_check_table(rows: StudyRows, rates: Sequence[float], training: dict) -> str:
    """Tool use against vanilla at the same outage rate, paired, next to the mechanism's prediction (the toy's
    exact expected push: without fatal rollouts the modes are one algorithm; with counted outages vanilla pushes
    tool use least, fatal masking a little more, hard masking and the clamp most)."""
    lines = [
        f"| outage | mode | Δ {CALLS.name} | Δ {LOOKUPS.name} | fatal training rollouts, vanilla / mode | "
        "the mechanism predicts |",
        "|---:|---|---:|---:|---:|---|",
    ]
    fatal = {key: int(sums.get("fatal", 0)) for key, sums in training.items()}
    for rate in rates:
        base = (rate, MAIN_CHOICE, "vanilla")
        for mode in MODES[1:]:
            key = (rate, MAIN_CHOICE, mode)
            if not rows.seeds(key) or not rows.seeds(base):
                continue
            counts = f"{fatal.get(base, 0)} / {fatal.get(key, 0)}"
            predicted = "above vanilla" if fatal.get(base, 0) or fatal.get(key, 0) else "equal (nothing fatal)"
            deltas = [_fmt(_estimate(rows, key, metric, base), signed=True, digits=2) for metric in (CALLS, LOOKUPS)]
            lines.append(f"| {rate:g} | {mode} | {deltas[0]} | {deltas[1]} | {counts} | {predicted} |")
    return "\n".join(lines)


def write_power(study: StudyConfig, doc: str | None = None) -> Power:
    """The pilot's power (:mod:`osvl.study.power`), kept beside the runs and, with ``doc``, in its power block."""
    power = pilot_power(load_rows(study), study)
    save_power(power, study)
    if doc is not None:
        path = Path(doc)
        path.write_text(fill_block(path.read_text(), POWER, power_markdown(power, study), doc))
    return power


def tool_use_table(
    rows: StudyRows, rates: Sequence[float], choice: str = MAIN_CHOICE, modes: Sequence[str] = MODES
) -> str:
    lines = [
        "| Method | outage | " + " | ".join(m.name for m in TOOL_USE) + " |",
        "|---|---:|" + "---:|" * len(TOOL_USE),
    ]
    lines.append("| SFT only | – | " + " | ".join(_fmt(_estimate(rows, None, m), digits=2) for m in TOOL_USE) + " |")
    for rate in rates:
        for mode in modes:
            key = (rate, choice, mode)
            if rows.seeds(key):
                lines.append(
                    f"| {LABELS[mode]} | {rate:g} | "
                    + " | ".join(_fmt(_estimate(rows, key, m), digits=2) for m in TOOL_USE)
                    + " |"
                )
    return "\n".join(lines)


def choices_table(rows: StudyRows, study: StudyConfig, training: dict) -> str:
    """At the choice rate: each error-counting choice x mode, held-out accuracy and tool use, and what
    training met (outage-hit, kept and fatal shares of the rollouts)."""
    rate = study.choice_rate
    choices = [MAIN_CHOICE] + [f"{e}/{i}" for e, i in study.choices]
    lines = [
        "| fatal_errors / infra_rollouts | mode | accuracy | Δ vs all/keep | tool calls per answer | "
        "grounded answers | outage-hit rollouts | of them kept | fatal rollouts |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for choice in choices:
        for mode in study.choice_modes:
            key = (rate, choice, mode)
            if not rows.seeds(key):
                continue
            delta = None if choice == MAIN_CHOICE else _estimate(rows, key, ACCURACY, (rate, MAIN_CHOICE, mode))
            t = training.get(key, {})
            cells = [
                _fmt(_estimate(rows, key, ACCURACY)),
                _fmt(delta, signed=True),
                _fmt(_estimate(rows, key, CALLS), digits=2),
                _fmt(_estimate(rows, key, GROUNDED), digits=2),
                _share(t, "infra_hit", "rollouts"),
                _share(t, "infra_kept", "infra_hit"),
                _share(t, "fatal", "scored"),
            ]
            lines.append(f"| {choice} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _share(sums: dict, part: str, whole: str) -> str:
    return f"{sums[part] / sums[whole]:.1%}" if sums.get(whole) else "–"


def _last_per_step(records: list[dict]) -> list[dict]:
    """A resumed run logs the steps after its checkpoint again: keep the last record of each step."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def _step_rollouts(path: Path) -> list[dict]:
    """One step's recorded rollouts, the last record of each (group, sample) (a resumed step is re-appended)."""
    latest = {}
    for _, record in iter_jsonl(path):
        latest[(record["group_id"], record["sample_index"])] = record
    return list(latest.values())


def _met_infra_error(record: dict) -> bool:
    return any((s.get("tool_result") or {}).get("status") == "infra_error" for s in record["steps"])


def training_sums(study: StudyConfig) -> dict[tuple[float, str, str], dict[str, float]]:
    """Per setting, over every finished run's training steps: rollout counts, outage hits, fatal ones,
    and the Figure 5 split of the fatal ones by their standardised group score (the paper's z, recomputed
    from the recorded rewards) and by the run's own estimator."""
    sums: dict[tuple[float, str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for spec in plan(study):
        directory = run_dir(study, spec)
        if not (directory / DONE).is_file():
            continue
        out = sums[(spec.outage_rate, spec.choice, spec.mode)]
        for path in sorted((directory / "rollouts").glob("rollouts_step*.jsonl")):
            records = _step_rollouts(path)
            rewards = [None if r["reward"] is None else r["reward"]["total"] for r in records]
            reasons = [
                None
                if r["reward"] is not None and r["reward"]["total"] is not None
                else (
                    "infra_error"
                    if r["reward"] is not None and r["reward"]["unscored_reason"] == "infra_error"
                    else "unscored"
                )
                for r in records
            ]
            groups, fatal = [r["group_id"] for r in records], [r["fatal_step"] for r in records]
            z = batch_stats(compute_advantages(rewards, groups, fatal, AdvantageConfig(estimator="grpo"), reasons))
            out["rollouts"] += len(records)
            out["scored"] += z.scored
            out["fatal"] += z.fatal
            out["infra_hit"] += sum(map(_met_infra_error, records))
            statuses = [s["tool_result"]["status"] for r in records for s in r["steps"] if s.get("tool_result")]
            out["tool_calls"] += len(statuses)
            out["timeouts"] += statuses.count("timeout")
            out["infra_kept"] += sum(_met_infra_error(r) and reason is None for r, reason in zip(records, reasons))
            out["zeroed"] += z.clamped
            out["preserved"] += z.preserved
            out["sum_zeroed"] += (z.mean_pre_clamp_zeroed or 0.0) * z.clamped
            out["sum_preserved"] += (z.mean_pre_clamp_preserved or 0.0) * z.preserved
        for record in _last_per_step([r for _, r in iter_jsonl(directory / "metrics.jsonl")]):
            out["rloo_zeroed"] += record.get("clamped", 0.0)
            out["rloo_preserved"] += record.get("preserved", 0.0)
            out["rloo_sum_zeroed"] += record.get("mean_pre_clamp_zeroed", 0.0) * record.get("clamped", 0.0)
            out["rloo_sum_preserved"] += record.get("mean_pre_clamp_preserved", 0.0) * record.get("preserved", 0.0)
    return {key: dict(value) for key, value in sums.items()}


def _ratio(totals: dict[str, float], total: str, count: str) -> str:
    """A signed mean of ``total`` over ``count``; a dash when nothing was counted."""
    return f"{totals[total] / totals[count]:+.2f}" if totals.get(count) else "–"


def clamp_table(training: dict, study: StudyConfig) -> str:
    """The Figure 5 split of fatal training rollouts: zeroed (negative group score) vs preserved."""
    lines = [
        "| setting | fatal rollouts | zeroed / preserved (z) | mean z: zeroed / preserved | "
        "zeroed / preserved (run's RLOO score) | mean RLOO score: zeroed / preserved |",
        "|---|---:|---:|---:|---:|---:|",
        f"| paper (Fig. 5, 47,978 fatal of 10,000 groups of 16) | 47,978 | {PAPER_FIGURE_5['zeroed']:.1%} / "
        f"{PAPER_FIGURE_5['preserved']:.1%} | {PAPER_FIGURE_5['mean_zeroed']:+.2f} / "
        f"{PAPER_FIGURE_5['mean_preserved']:+.2f} | – | – |",
    ]
    for (rate, choice, mode), t in sorted(training.items()):
        fatal = t.get("zeroed", 0) + t.get("preserved", 0)
        rloo = t.get("rloo_zeroed", 0) + t.get("rloo_preserved", 0)
        if not fatal:
            lines.append(f"| outage {rate:g}, {choice}, {mode} | 0 | – | – | – | – |")
            continue
        cells = [
            str(int(fatal)),
            f"{t['zeroed'] / fatal:.1%} / {t['preserved'] / fatal:.1%}",
            f"{_ratio(t, 'sum_zeroed', 'zeroed')} / {_ratio(t, 'sum_preserved', 'preserved')}",
            f"{t['rloo_zeroed'] / rloo:.1%} / {t['rloo_preserved'] / rloo:.1%}" if rloo else "–",
            f"{_ratio(t, 'rloo_sum_zeroed', 'rloo_zeroed')} / {_ratio(t, 'rloo_sum_preserved', 'rloo_preserved')}",
        ]
        lines.append(f"| outage {rate:g}, {choice}, {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curves(study: StudyConfig) -> dict[tuple[float, str, str], dict[str, np.ndarray]]:
    """Per setting: training-rollout accuracy and tool calls per rollout at each step, one row per seed."""
    out: dict[tuple[float, str, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for spec in plan(study):
        directory = run_dir(study, spec)
        if not (directory / DONE).is_file():
            continue
        records = _last_per_step([r for _, r in iter_jsonl(directory / "metrics.jsonl")])
        for key in ("accuracy", "tool_calls_mean", "fatal_rate"):
            out[(spec.outage_rate, spec.choice, spec.mode)][key].append([r.get(key, math.nan) for r in records])
    return {k: {m: np.array(v, dtype=np.float64) for m, v in d.items()} for k, d in out.items()}


def plot_curves(study: StudyConfig, figures: Path) -> list[Path]:
    """One figure per metric: a panel per outage rate, a line per mode (mean over seeds, band = min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(study)
    figures.mkdir(parents=True, exist_ok=True)
    written = []
    titles = {
        "accuracy": "training-rollout accuracy",
        "tool_calls_mean": "tool calls per rollout",
        "fatal_rate": "fatal share of rollouts",
    }
    for metric, title in titles.items():
        fig, axes = plt.subplots(1, len(study.rates), figsize=(5 * len(study.rates), 3.5), squeeze=False)
        for ax, rate in zip(axes[0], study.rates):
            for mode in MODES:
                values = data.get((rate, MAIN_CHOICE, mode), {}).get(metric)
                if values is None or values.size == 0:
                    continue
                steps = np.arange(1, values.shape[1] + 1)
                smooth = _moving_average(values, 4)
                (line,) = ax.plot(steps, smooth.mean(axis=0), label=f"{mode} ({values.shape[0]} seeds)")
                ax.fill_between(steps, smooth.min(axis=0), smooth.max(axis=0), color=line.get_color(), alpha=0.15)
            ax.set_title(f"outage {rate:g} ({MAIN_CHOICE})")
            ax.set_xlabel("GRPO step")
            ax.set_ylabel(f"{title} (4-step mean)")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        path = figures / f"{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _moving_average(values: np.ndarray, width: int) -> np.ndarray:
    """Trailing mean over up to ``width`` steps (each row a seed): training rollouts are 16 a step."""
    out = np.empty_like(values)
    for step in range(values.shape[1]):
        out[:, step] = np.nanmean(values[:, max(0, step - width + 1) : step + 1], axis=1)
    return out


def study_summary(study: StudyConfig, rows: StudyRows) -> str:
    cpu = wall = 0.0
    for spec in [*plan(study), None]:
        done = run_dir(study, spec or SFT_RUN) / DONE
        if done.is_file():
            record = json.loads(done.read_text())
            cpu += record["train_cpu_s"] + record["eval_cpu_s"]
            wall += record["train_wall_s"] + record["eval_wall_s"]
    cut, evaluated = rows.cut_short()
    warning = (
        f" **{cut} of {evaluated} evaluation rollouts were cut short by the trajectory deadline or the engine "
        "and count as unanswered.**"
        if cut
        else ""
    )
    return (
        f"{rows.done} of {rows.planned} GRPO runs finished (plus the SFT evaluation: "
        f"{'done' if rows.sft else 'not yet'}); {study.steps} GRPO steps each, seeds {list(study.seeds)}, "
        f"{len(rows.prompts)} held-out prompts evaluated greedily. The finished runs took {cpu / 3600:.2f} "
        f"CPU-hours ({wall / 3600:.2f} h of wall time summed over runs, on whatever load the machine had)." + warning
    )


def write_report(study: StudyConfig, doc: str | None = None, figures: str | None = None) -> str:
    """The generated markdown; written between the markers of ``doc`` when given, else to ``OUT/report.md``."""
    rows = load_rows(study)
    training = training_sums(study)
    calls = sum(t.get("tool_calls", 0) for t in training.values())
    timeouts = sum(t.get("timeouts", 0) for t in training.values())
    figures_dir = Path(figures) if figures else Path(study.out) / "figures"
    written = plot_curves(study, figures_dir)
    base = Path(doc).parent if doc else Path(study.out)
    links = " ".join(f"![{p.stem}]({_relative(p, base)})" for p in written)
    intervals = "anchor entities" if len(set(rows.clusters)) < len(rows.prompts) else "prompts"
    sections = [
        study_summary(study, rows)
        + (
            f" Tool calls in training rollouts: {int(calls)}, of which {int(timeouts)} "
            "timed out (a timeout counts as the policy's error)."
            if calls
            else ""
        ),
        "**Held-out accuracy (greedy, no faults or outages), Table 3b layout.** Mean over seeds and prompts; "
        f"[95% two-level bootstrap interval over seeds and {intervals}]; Δ: against vanilla GRPO at the same outage "
        "rate, paired by prompt and by seed (seed k of every setting draws the same sampling and outage streams). "
        "The paper's column is its 3-benchmark average for Qwen3-VL-8B, for the layout only.",
        table_3b(rows, study.rates),
        "**The paper's ordering, step by step** (paired as above; shown: the interval clears zero in the paper's "
        "direction; reversed: it clears zero the other way; undetermined: it holds zero, and a difference below "
        "the pilot's detectable size would look like this).",
        orderings_table(rows, study.rates, read_power(study)),
        "**Tool use on the held-out prompts.** Tool calls per answer: calls made by rollouts that answered, per "
        "answer; 2-hop questions with every lookup issued: share of the 2-hop chain questions whose rollout looked "
        "up each relation on the entity its own evidence named (the habit GRPO teaches in the demo); answers "
        "without a tool: share of answers given with no tool call; grounded: share of answers stated word for word "
        "by one of the rollout's observations; answered: share of prompts answered.",
        tool_use_table(rows, study.rates),
        "**Tool use against the mechanism's prediction** (each mode minus vanilla at the same outage rate, paired "
        "as above; the prediction is the sign of the exact expected push on tool use in the toy above).",
        mechanism_check_table(rows, study.rates, training),
    ]
    if study.choices:
        sections += [
            f"**Which errors count, at outage {study.choice_rate:g}.** Held-out accuracy and tool use, and what the "
            "training rollouts met (shares over all training steps and seeds).",
            choices_table(rows, study, training),
        ]
    sections += [
        "**The one-sided clamp's bookkeeping** (every fatal training rollout of every finished run; the split is "
        "computed in every mode, so the non-clamping modes show what the clamp would have done). z: the paper's "
        "standardised group score, recomputed from the recorded rewards; RLOO: the score the runs trained with.",
        clamp_table(training, study),
        f"**Training curves** (training rollouts, {study.group_size * study.batch_prompts} a step, at temperature "
        "0.7 and under the run's outages; mean over seeds, band: min to max over seeds).",
        links,
    ]
    block = "\n\n".join(sections)
    mechanism = push_markdown(push_table(ToyAgent()), ToyAgent())
    if doc is None:
        target = Path(study.out) / "report.md"
        target.write_text(f"{block}\n\n**The mechanism, exactly** (`osvl.study.mechanism`).\n\n{mechanism}\n")
        return block
    path = Path(doc)
    text = fill_block(path.read_text() if path.is_file() else f"{BEGIN}\n{END}\n", (BEGIN, END), block, doc)
    if MECHANISM[0] in text:
        text = fill_block(text, MECHANISM, mechanism, doc)
    path.write_text(text)
    return block


def fill_block(text: str, markers: tuple[str, str], block: str, doc: str) -> str:
    """``text`` with what stands between the two markers replaced by ``block``."""
    begin, end = markers
    if begin not in text or end not in text or text.index(begin) > text.index(end):
        raise ValueError(f"{doc} has no {begin} ... {end} block to fill")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)
