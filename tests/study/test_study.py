"""The fatal-mode study end to end in its quick form (a scripted searcher on tiny inputs, so it runs in CI):
every run trains and is evaluated, outages reach the training rollouts, the report's statistics are
well formed, and a second call resumes instead of rerunning. It asserts that the study works, not what it finds."""

from __future__ import annotations

import ctypes
import io
import json
import multiprocessing
import re
import signal
from dataclasses import replace

import pytest

from osvl.rl.advantages import MODES
from osvl.rl.trajectory import FinishReason, Prompt, Trajectory
from osvl.study import runs
from osvl.study.__main__ import main
from osvl.study.power import read_power
from osvl.study.report import BEGIN, END, MECHANISM, POWER, write_report
from osvl.study.rows import load_rows
from osvl.study.runs import DONE, QUICK, ROWS, SFT_RUN, RunSpec, StudyConfig, plan, prompt_row, run_dir, run_study
from osvl.world.__main__ import main as world_main
from tests.rl.helpers import ZOO_QUESTION, zoo_chain_steps
from tests.study.fixtures import TINY, searcher, study_inputs

pytestmark = pytest.mark.slow

NUMBER = r"[+-]?\d+\.\d+"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablation")
    assert world_main(["build", "--out", str(root / "world"), "--seed", "0"]) == 0
    study = replace(QUICK, out=str(root / "study"), overrides=TINY, **study_inputs(root, root / "world"))
    progress = io.StringIO()
    result = run_study(study, jobs=2, engine_wrapper=searcher, stream=progress, poll_s=0.5)
    return study, result, progress.getvalue()


def test_the_plan_covers_modes_seeds_rates_and_error_choices():
    specs = plan(QUICK)
    assert len(specs) == len(set(specs)) == 2 * (4 * 2 + 2)
    assert {(s.outage_rate, s.choice) for s in specs} == {
        (0.0, "all/keep"),
        (0.3, "all/keep"),
        (0.3, "policy/drop"),
        (0.3, "policy/keep"),
    }
    assert {s.mode for s in specs if s.choice == "all/keep"} == set(MODES)
    assert [s.seed for s in specs] == sorted(s.seed for s in specs)  # seed-major: a half study has every setting
    full = plan(StudyConfig())  # the four modes x both outage rates under all/keep; other choices on request
    assert len(full) == 3 * 4 * 2 and {s.seed for s in full} == {0, 1, 2}
    assert {s.choice for s in full} == {"all/keep"} and StudyConfig().group_size >= 8


def test_every_run_trains_and_is_evaluated(quick):
    study, result, progress = quick
    assert result.failed == [] and result.skipped == []
    assert sorted(result.done) == sorted([SFT_RUN] + [s.name for s in plan(study)])
    for spec in plan(study):
        directory = run_dir(study, spec)
        done = json.loads((directory / DONE).read_text())
        assert done["steps"] == 2 and done["prompts"] == 4 and done["train_cpu_s"] > 0
        rows = [json.loads(line) for line in (directory / ROWS).read_text().splitlines()]
        assert sorted(r["prompt"] for r in rows) == ["p6", "p7", "p8", "p9"]
        metrics = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        assert json.loads((directory / "recipe.json").read_text())["grpo"]["fatal_mode"] == spec.mode
    assert re.search(r"\] 21/21 runs", progress)


def test_outages_reach_training_as_the_error_choice_says(quick):
    study, _, _ = quick
    totals = {}
    for spec in plan(study):
        metrics = [json.loads(line) for line in (run_dir(study, spec) / "metrics.jsonl").read_text().splitlines()]
        key = (spec.outage_rate, spec.choice)
        for name in ("infra_hit", "infra_kept", "infra_dropped", "fatal"):
            totals.setdefault(key, {}).setdefault(name, 0.0)
            totals[key][name] += sum(m[name] for m in metrics)
    assert totals[(0.0, "all/keep")]["infra_hit"] == 0
    paper, dropped, kept = totals[(0.3, "all/keep")], totals[(0.3, "policy/drop")], totals[(0.3, "policy/keep")]
    assert paper["infra_hit"] > 0 and paper["infra_kept"] == paper["infra_hit"] and paper["infra_dropped"] == 0
    assert dropped["infra_hit"] > 0 and dropped["infra_dropped"] == dropped["infra_hit"] and dropped["infra_kept"] == 0
    assert kept["infra_kept"] == kept["infra_hit"] > 0


def test_the_report_is_well_formed(quick, tmp_path):
    study, _, _ = quick
    doc = tmp_path / "ablation.md"
    doc.write_text(f"# reading\n\n{BEGIN}\nold\n{END}\n\nmiddle\n{MECHANISM[0]}\nstale\n{MECHANISM[1]}\nafter\n")
    block = write_report(study, doc=str(doc), figures=str(tmp_path / "figures"))
    text = doc.read_text()
    assert text.startswith("# reading") and text.endswith("after\n") and block in text
    assert "\nold\n" not in text and "stale" not in text and "middle" in text
    assert "| fatal_clamp |" in text.split(MECHANISM[0])[1]  # the toy's exact table, refreshed
    table = ("| Method | accuracy" + block.split("| Method | accuracy")[1].split("\n\n")[0]).splitlines()
    for label in (
        "SFT only",
        "+ Vanilla GRPO",
        "+ GRPO w/ Hard Masking",
        "+ GRPO w/ Fatal Masking only",
        "+ Fatal Masking + One-sided Clamp",
    ):
        assert f"| {label} |" in block
    assert len({line.count("|") for line in table}) == 1  # every row has the header's columns
    estimates = re.findall(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]", block)
    assert len(estimates) > 30
    for value, low, high in map(lambda e: tuple(map(float, e)), estimates):
        assert low <= high and low - 1e-9 <= value <= high + 1e-9 or (low <= high and value == 0.0)
    accuracies = [float(v) for v in re.findall(rf"\| ({NUMBER}) \[{NUMBER}, {NUMBER}\] \(2 seeds\)", block)]
    assert len(accuracies) == 8 and all(0.0 <= a <= 1.0 for a in accuracies)
    assert "21 of 20" not in block and "20 of 20 GRPO runs finished" in block
    check = block.split("**Tool use against the mechanism's prediction**")[1].split("\n\n")[1].splitlines()
    assert len(check) == 2 + 2 * 3  # header, rule, and each mode but vanilla at both outage rates
    assert all(line.endswith(("| above vanilla |", "| equal (nothing fatal) |")) for line in check[2:])
    for name in ("accuracy", "tool_calls_mean", "fatal_rate"):
        assert (tmp_path / "figures" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = load_rows(study)
    assert rows.sft is not None and len(rows.prompts) == 4


def test_a_second_call_resumes_and_an_unfinished_run_is_completed(quick):
    study, _, _ = quick
    spec = RunSpec("vanilla", 1, 0.3)
    (run_dir(study, spec) / DONE).unlink()  # as if the study had been stopped during this run's evaluation
    (run_dir(study, spec) / ROWS).unlink()
    progress = io.StringIO()
    result = run_study(study, jobs=2, engine_wrapper=searcher, stream=progress, poll_s=0.5)
    assert result.done == [spec.name] and len(result.skipped) == 20 and result.failed == []
    done = json.loads((run_dir(study, spec) / DONE).read_text())
    assert done["train_wall_s"] < 1.0  # its training was done: only the evaluation ran again
    metrics = (run_dir(study, spec) / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2


def test_missing_inputs_and_bad_settings_are_named(tmp_path, capsys):
    study = replace(QUICK, out=str(tmp_path / "s"), sft=str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match=r"missing inputs: --sft .*nothing/config.json.*`make demo`"):
        run_study(study)
    with pytest.raises(ValueError, match="unknown fatal modes"):
        StudyConfig(modes=("soft",))
    with pytest.raises(ValueError, match="error-counting choice all/drop"):
        StudyConfig(choices=(("all", "drop"),))
    with pytest.raises(ValueError, match="jobs and threads"):
        run_study(QUICK, jobs=0)
    with pytest.raises(SystemExit):
        main(["run", "--quick", "--sft", str(tmp_path / "nothing"), "--out", str(tmp_path / "s")])
    assert "missing inputs" in capsys.readouterr().err
    assert main(["plan", "--quick", "--out", str(tmp_path / "s"), "--seeds", "0"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 10 and all(line.endswith("to run") for line in listed)


def test_a_prompt_row_keeps_the_anchor_hops_and_lookups_of_a_chain_question():
    image, founder = zoo_chain_steps()
    prompt = Prompt("z", ZOO_QUESTION, answer="x", anchor="Jorzel_Zoo", hops=2)
    stopped = prompt_row(Trajectory(prompt, [image, founder], FinishReason.RESPONSE, 0, 0))
    assert (stopped["anchor"], stopped["hops"], stopped["lookups"]) == ("Jorzel_Zoo", 2, [1, 2])
    city = Prompt("y", "Which city is number 3?", answer="x")
    other = prompt_row(Trajectory(city, [founder], FinishReason.RESPONSE, 0, 0))
    assert other["lookups"] is None and other["anchor"] == "" and other["tool_calls"] == 1


def test_power_from_the_quick_pilot_names_its_verdict(quick, tmp_path, capsys):
    study, _, _ = quick
    doc = tmp_path / "ablation.md"
    doc.write_text(f"intro\n{POWER[0]}\nold\n{POWER[1]}\nafter\n")
    code = main(["power", "--quick", "--out", study.out, "--doc", str(doc)])
    printed = capsys.readouterr().out
    power = read_power(study)
    assert power is not None and power.seeds == [0, 1] and power.steps == 2
    assert code == (0 if power.gains else 1) and "detectable at 80% power" in printed
    text = doc.read_text()
    assert "\nold\n" not in text and text.startswith("intro") and text.endswith("after\n")
    assert f"**{power.detectable:.3f}**" in text


def test_a_run_process_dies_with_the_study(tmp_path, monkeypatch):
    """Its parent-death signal is armed before the run starts (what that signal does: tests/test_lifetime.py)."""

    def report_parent_death_signal(*_):
        value = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
        print(f"parent-death signal {value.value}")

    monkeypatch.setattr(runs, "run_one", report_parent_death_signal)
    log = tmp_path / "log.txt"
    process = multiprocessing.get_context("fork").Process(target=runs._child, args=(QUICK, None, 1, None, str(log)))
    process.start()
    process.join(60)
    assert process.exitcode == 0 and log.read_text() == f"parent-death signal {int(signal.SIGKILL)}\n"
