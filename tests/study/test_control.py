"""The recall control and the 3-hop probe: tables and paired intervals from evaluation results."""

from __future__ import annotations

import json

import pytest

from osvl.study.__main__ import main
from osvl.study.control import (
    BEGIN,
    END,
    cell_path,
    control_markdown,
    looked_up,
    probe_path,
    with_hops,
    write_control,
)

ANCHORS = {f"p{i}": f"a{i // 2}" for i in range(12)}  # 6 anchors, a 1-hop and a 2-hop question each
HOPS = {f"p{i}": 1 + i % 2 for i in range(12)}


def _result(right_two_hop: set[int], looked: set[int], hops: dict[str, int] = HOPS) -> dict:
    """An evaluation: every 1-hop question right; a question of more hops right when its anchor's index is in
    ``right_two_hop``; its lookups complete when the index is in ``looked``."""
    per_prompt, lookups = {}, {}
    for prompt, n in hops.items():
        anchor = int(ANCHORS[prompt][1:])
        per_prompt[prompt] = 1.0 if n == 1 or anchor in right_two_hop else 0.0
        lookups[prompt] = [n + 1 if n == 1 or anchor in looked else n, n + 1]
    accuracy = sum(per_prompt.values()) / len(per_prompt)
    return {
        "checkpoint": "x",
        "prompts": len(per_prompt),
        "accuracy": accuracy,
        "per_prompt": per_prompt,
        "anchors": ANCHORS,
        "hops": hops,
        "lookups": lookups,
    }


def _write(directory, seeds=(0, 1)):
    cells = {
        ("0", "sft"): ({0, 1, 2}, {0, 1, 2, 3, 4, 5}),  # looks up every time, answers half
        ("0", "grpo"): ({0, 1, 2, 3}, {0, 1, 2, 3, 4, 5}),
        ("0.7", "sft"): ({0}, {0}),  # the planted habit: guesses instead of looking up
        ("0.7", "grpo"): ({0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}),
    }
    for seed in seeds:
        for (recall, stage), (right, looked) in cells.items():
            cell_path(directory, recall, stage, seed).write_text(json.dumps(_result(right, looked)))
        three = {p: 3 for p in HOPS}
        probe_path(directory, "sft", seed).write_text(json.dumps(_result({0, 1}, {0, 1}, three)))
        probe_path(directory, "grpo", seed).write_text(json.dumps(_result({0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, three)))


def test_hop_subsets_and_lookup_completion():
    result = _result({0, 1}, {0})
    assert with_hops(result, 2) == {"p1": 1.0, "p3": 1.0, "p5": 0.0, "p7": 0.0, "p9": 0.0, "p11": 0.0}
    assert looked_up(result, 2) == {"p1": 1.0, "p3": 0.0, "p5": 0.0, "p7": 0.0, "p9": 0.0, "p11": 0.0}
    del result["lookups"]["p1"]
    assert looked_up(result, 2)["p1"] is None
    del result["lookups"]
    with pytest.raises(ValueError, match="without per-prompt lookups"):
        looked_up(result, 2)


def test_control_table_and_verdicts(tmp_path):
    _write(tmp_path)
    text = control_markdown(tmp_path, [0, 1])
    rows = [line for line in text.splitlines() if line.startswith("| recall")]
    assert rows == [
        "| recall 0 | SFT | 0.500 [0.500, 0.500] | 1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] "
        "| 0.750 [0.750, 0.750] |",
        "| recall 0 | SFT + GRPO | 0.667 [0.667, 0.667] | 1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] "
        "| 0.833 [0.833, 0.833] |",
        "| recall 0.7 | SFT | 0.167 [0.167, 0.167] | 0.167 [0.167, 0.167] | 1.000 [1.000, 1.000] "
        "| 0.583 [0.583, 0.583] |",
        "| recall 0.7 | SFT + GRPO | 1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] "
        "| 1.000 [1.000, 1.000] |",
    ]
    question = next(line for line in text.splitlines() if line.startswith("- the question"))
    # GRPO from the recall policy answers all six 2-hop questions, the no-recall SFT three: +0.5, but the
    # three anchors both answer carry no difference, so a bootstrap over anchors can draw zero
    assert "recall 0.7 GRPO - recall 0 SFT: **+0.500**" in question
    withheld = next(line for line in text.splitlines() if line.startswith("- what the recall drills withheld"))
    # right on two anchors more, equal on four: a draw of the four alone gives zero, so not distinguishable;
    # lookups complete on five anchors more, equal on one: every draw is above zero
    assert "**+0.333** [+0.000, " in withheld and "recall 0 SFT is not distinguishable from" in withheld
    assert "lookups +0.833 [+0.500, +1.000]" in withheld
    said = next(line for line in text.splitlines() if line.startswith("- what GRPO gave the recall policy"))
    assert "**+0.833** [+0.500, +1.000]: recall 0.7 GRPO is above recall 0.7 SFT" in said
    probe = text.split("**A chain longer than any trained**")[1]
    assert "12 held-out 3-hop questions from 6 evaluation anchors" in probe  # every question asks 3 hops here
    assert "| 0 | 0.333 | 0.833 | +0.500" in probe and "| 0.333 | 0.833 |" in probe
    assert "Pooled: accuracy GRPO - SFT: **+0.500**" in probe


def test_control_needs_two_seeds_and_every_evaluation(tmp_path):
    _write(tmp_path, seeds=(0,))
    with pytest.raises(ValueError, match=">= 2 SFT seeds"):
        control_markdown(tmp_path, [0])
    with pytest.raises(ValueError, match="recall0_sft_seed1.json is missing"):
        control_markdown(tmp_path, [0, 1])


def test_cli_fills_the_docs_block_and_keeps_the_rest(tmp_path, capsys):
    _write(tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n")
    assert main(["control", "--evals", str(tmp_path), "--seeds", "0", "1", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"before\n{BEGIN}\n**The recall control**") and text.endswith(f"{END}\nafter\n")
    assert "old" not in text and "**The recall control**" in capsys.readouterr().out
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="no <!-- control:begin -->"):
        write_control(tmp_path, [0, 1], doc)
