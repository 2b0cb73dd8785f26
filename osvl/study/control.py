"""The recall control and the longer-chain probe of the study (docs/ablation.md), from greedy evaluations
(``python -m osvl.demo evaluate``; ``make study-control`` runs the policies and evaluations).

The demo's SFT data plants a habit: in a share of its lookup drills (``--recall``) the expert answers the
last hop from memory instead of looking it up, and GRPO then teaches the policy to look it up. The control
asks whether GRPO only undid that habit or taught more: SFT without the recall drills against SFT with them,
each alone and followed by the demo's GRPO, over SFT seeds, on the 2-hop questions where the habit acts.
The probe asks whether the look-it-up decision carries to 3-hop questions, longer than any either stage
trained on. Every comparison is paired by prompt and seed, with a bootstrap over seeds and anchor entities.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from osvl.eval.interval import Estimate, clustered_paired_difference
from osvl.study.report import fill_block

RECALLS = ("0", "0.7")  # the SFT data's recall share: without the planted habit, and the demo's
STAGES = ("sft", "grpo")
BEGIN, END = "<!-- control:begin -->", "<!-- control:end -->"


def cell_path(directory: str | Path, recall: str, stage: str, seed: int) -> Path:
    return Path(directory) / f"recall{recall}_{stage}_seed{seed}.json"


def probe_path(directory: str | Path, stage: str, seed: int) -> Path:
    return Path(directory) / f"hop3_{stage}_seed{seed}.json"


def with_hops(result: Mapping, hops: int) -> dict[str, float | None]:
    """The evaluation's per-prompt accuracy on its questions of ``hops`` hops."""
    return {p: acc for p, acc in result["per_prompt"].items() if result["hops"].get(p) == hops}


def looked_up(result: Mapping, hops: int) -> dict[str, float | None]:
    """1.0 where the policy issued every lookup its ``hops``-hop question asks (on the entities its own
    evidence named), else 0.0; None for a question the evaluation holds no lookup record of."""
    if "lookups" not in result:
        raise ValueError(f"{result.get('checkpoint')}: an evaluation without per-prompt lookups (re-run it)")
    rows = {}
    for prompt in with_hops(result, hops):
        pair = result["lookups"].get(prompt)
        rows[prompt] = None if pair is None else float(pair[0] == pair[1])
    return rows


def _mean(rows: Mapping[str, float | None]) -> float:
    values = [v for v in rows.values() if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _paired(after: Sequence[Mapping], before: Sequence[Mapping], anchors: Mapping[str, str]) -> Estimate:
    return clustered_paired_difference(list(after), list(before), anchors)


def _said(estimate: Estimate, after: str, before: str) -> str:
    verdict = "above" if estimate.low > 0 else "below" if estimate.high < 0 else "not distinguishable from"
    return (
        f"{after} - {before}: **{estimate.value:+.3f}** [{estimate.low:+.3f}, {estimate.high:+.3f}]: {after} is "
        f"{verdict} {before}"
    )


def _load(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} is missing: run `make study-control` (after `make demo` and `make demo-seeds`)")
    return json.loads(path.read_text())


def _anchors(results: Sequence[Mapping]) -> dict[str, str]:
    return {p: a for result in results for p, a in result["anchors"].items()}


def control_markdown(directory: str | Path, seeds: Sequence[int]) -> str:
    """The 2x2 control (SFT data with and without the recall drills x SFT alone and + GRPO) on the 2-hop
    questions, and the 3-hop probe, as markdown."""
    if len(seeds) < 2:
        raise ValueError(f"the control needs >= 2 SFT seeds (an interval over seeds), got {list(seeds)}")
    cells = {(r, s): [_load(cell_path(directory, r, s, seed)) for seed in seeds] for r in RECALLS for s in STAGES}
    anchors = _anchors([result for results in cells.values() for result in results])
    two = {key: [with_hops(r, 2) for r in results] for key, results in cells.items()}
    lookups = {key: [looked_up(r, 2) for r in results] for key, results in cells.items()}
    asked = len(two[RECALLS[0], STAGES[0]][0])
    lines = [
        f"**The recall control** ({len(seeds)} SFT seeds: {', '.join(map(str, seeds))}; each SFT policy and its own "
        f"GRPO run, greedy on the {asked} two-hop questions of the {cells[RECALLS[0], STAGES[0]][0]['prompts']} "
        "held-out ones; *lookups*: the share whose every lookup was issued on the entity the policy's own "
        "evidence named; ranges over seeds in brackets).",
        "",
        "| SFT data | policy | 2-hop accuracy | 2-hop lookups | 1-hop accuracy | all |",
        "|---|---|---|---|---|---|",
    ]
    for recall in RECALLS:
        for stage in STAGES:
            acc = [_mean(rows) for rows in two[recall, stage]]
            look = [_mean(rows) for rows in lookups[recall, stage]]
            one = [_mean(with_hops(r, 1)) for r in cells[recall, stage]]
            total = [r["accuracy"] for r in cells[recall, stage]]
            lines.append(
                f"| recall {recall} | {'SFT' if stage == 'sft' else 'SFT + GRPO'} | {_spread(acc)} | {_spread(look)} "
                f"| {_spread(one)} | {_spread(total)} |"
            )
    low, high = RECALLS
    compared = [
        (
            (high, "grpo"),
            (low, "sft"),
            "the question, GRPO from the recall policy against SFT that never learned the habit",
        ),
        ((high, "grpo"), (high, "sft"), "what GRPO gave the recall policy"),
        ((low, "sft"), (high, "sft"), "what the recall drills withheld from SFT"),
        ((low, "grpo"), (low, "sft"), "what GRPO gave the policy without them"),
    ]
    lines += ["", "Paired differences on the 2-hop questions (95% bootstrap over seeds and anchor entities):", ""]
    for after, before, why in compared:
        names = (f"recall {after[0]} {after[1].upper()}", f"recall {before[0]} {before[1].upper()}")
        accuracy = _paired(two[after], two[before], anchors)
        lookup = _paired(lookups[after], lookups[before], anchors)
        lines.append(
            f"- {why}: accuracy {_said(accuracy, *names)}; lookups {lookup.value:+.3f} "
            f"[{lookup.low:+.3f}, {lookup.high:+.3f}]"
        )
    return "\n".join([*lines, "", probe_markdown(directory, seeds)])


def probe_markdown(directory: str | Path, seeds: Sequence[int]) -> str:
    """SFT against its GRPO on held-out 3-hop questions, per seed and pooled."""
    sft = [_load(probe_path(directory, "sft", seed)) for seed in seeds]
    grpo = [_load(probe_path(directory, "grpo", seed)) for seed in seeds]
    anchors = _anchors([*sft, *grpo])
    before, after = [with_hops(r, 3) for r in sft], [with_hops(r, 3) for r in grpo]
    if not before[0]:
        raise ValueError(f"{probe_path(directory, 'sft', seeds[0])} holds no 3-hop question")
    lines = [
        f"**A chain longer than any trained** (greedy on {len(before[0])} held-out 3-hop questions from "
        f"{len({anchors[p] for p in before[0]})} evaluation anchors; the demo's SFT and GRPO saw 1- and 2-hop "
        "chains only; intervals: 95% paired bootstrap over anchor entities, pooled: over seeds and anchors).",
        "",
        "| seed | SFT | SFT + GRPO | GRPO - SFT | lookups SFT | lookups GRPO |",
        "|---|---|---|---|---|---|",
    ]
    for seed, b, a, rb, ra in zip(seeds, before, after, sft, grpo, strict=True):
        diff = _paired([a], [b], anchors)
        lines.append(
            f"| {seed} | {_mean(b):.3f} | {_mean(a):.3f} | {diff.value:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}] "
            f"| {_mean(looked_up(rb, 3)):.3f} | {_mean(looked_up(ra, 3)):.3f} |"
        )
    pooled = _paired(after, before, anchors)
    lookup = _paired([looked_up(r, 3) for r in grpo], [looked_up(r, 3) for r in sft], anchors)
    lines += [
        "",
        f"Pooled: accuracy {_said(pooled, 'GRPO', 'SFT')}; lookups {lookup.value:+.3f} "
        f"[{lookup.low:+.3f}, {lookup.high:+.3f}].",
    ]
    return "\n".join(lines)


def _spread(values: Sequence[float]) -> str:
    return f"{sum(values) / len(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def write_control(directory: str | Path, seeds: Sequence[int], doc: str | Path | None = None) -> str:
    """The control's markdown, written between the ``control`` markers of ``doc`` when given."""
    block = control_markdown(directory, seeds)
    if doc is not None:
        path = Path(doc)
        path.write_text(fill_block(path.read_text(), (BEGIN, END), block, str(doc)))
    return block
