"""The fatal-mode ablation (paper Table 3b) from the command line: ``make ablation``.

    python -m osvl.study plan [--quick]           the runs, in order
    python -m osvl.study run [--quick] [--jobs 2]  run (or resume) them, with a progress bar
    python -m osvl.study run --modes vanilla --rates 0   the pilot alone
    python -m osvl.study power [--doc FILE]       the pilot's gain and the study's detectable difference;
                                                  fails when vanilla did not gain (the study would see nothing)
    python -m osvl.study report [--doc FILE]      tables and plots from what has finished
    python -m osvl.study control --evals DIR --seeds 0 1 [--doc FILE]
                                                  the recall control and the 3-hop probe (make study-control)

What a run is and how it resumes: :mod:`osvl.study.runs`; the power analysis: :mod:`osvl.study.power`; what the
report holds: :mod:`osvl.study.report`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from osvl.rl.advantages import MODES
from osvl.study.control import write_control
from osvl.study.report import write_power, write_report
from osvl.study.runs import DONE, OTHER_CHOICES, QUICK, StudyConfig, plan, run_dir, run_study


def _study(args: argparse.Namespace) -> StudyConfig:
    base = QUICK if args.quick else StudyConfig()
    given = {
        key: getattr(args, key)
        for key in ("out", "sft", "world", "tokenizer", "prompts", "eval_prompts")
        if getattr(args, key) is not None
    }
    for key in ("steps", "lr"):
        if getattr(args, key) is not None:
            given[key] = getattr(args, key)
    for key in ("seeds", "modes", "rates"):
        if getattr(args, key) is not None:
            given[key] = tuple(getattr(args, key))
    if args.choices:
        given["choices"] = OTHER_CHOICES
    if args.no_choices:
        given["choices"] = ()
    if args.set:
        given["overrides"] = tuple(args.set)
    return replace(base, **given)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osvl.study", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("plan", "run", "power", "report"):
        command = sub.add_parser(name)
        command.add_argument("--quick", action="store_true", help="the smoke form: 2 steps, 2 seeds, 8 prompts")
        command.add_argument("--out", help="the study's directory (default runs/ablation, runs/ablation_quick)")
        for flag in ("sft", "world", "tokenizer", "prompts", "eval-prompts"):
            default = getattr(StudyConfig, flag.replace("-", "_"))
            command.add_argument(f"--{flag}", help=f"default: the demo's ({default})")
        command.add_argument("--steps", type=int)
        command.add_argument("--lr", type=float)
        command.add_argument("--seeds", type=int, nargs="+")
        command.add_argument("--modes", nargs="+", choices=MODES)
        command.add_argument("--rates", type=float, nargs="+", help="outage rates of the main grid")
        command.add_argument(
            "--choices", action="store_true", help="also policy/drop and policy/keep at outage 0.3 (vanilla, clamp)"
        )
        command.add_argument("--no-choices", action="store_true", help="no other error-counting choice")
        command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every run")
    sub.choices["run"].add_argument("--jobs", type=int, default=2, help="runs at once (one process each)")
    sub.choices["run"].add_argument("--threads", type=int, default=1, help="CPU threads per run")
    sub.choices["report"].add_argument("--doc", help="rewrite the generated block of this markdown file")
    sub.choices["power"].add_argument("--doc", help="rewrite the power block of this markdown file")
    sub.choices["report"].add_argument("--figures", help="where the plots go (default: OUT/figures)")
    control = sub.add_parser("control", help="the recall control and the 3-hop probe from their evaluations")
    control.add_argument("--evals", required=True, help="the evaluations' directory (osvl.study.control names)")
    control.add_argument("--seeds", type=int, nargs="+", required=True, help="the SFT seeds evaluated")
    control.add_argument("--doc", help="rewrite the control block of this markdown file")
    args = parser.parse_args(argv)
    try:
        if args.command == "control":
            print(write_control(args.evals, args.seeds, args.doc))
            return 0
        study = _study(args)
        if args.command == "plan":
            for spec in plan(study):
                state = "done" if (run_dir(study, spec) / DONE).is_file() else "to run"
                print(f"{spec.name}  {state}")
        elif args.command == "power":
            power = write_power(study, args.doc)
            print(
                f"vanilla - SFT {power.gain.value:+.3f} [{power.gain.low:+.3f}, {power.gain.high:+.3f}] over "
                f"{len(power.seeds)} seeds; detectable at 80% power: {power.detectable:.3f}"
            )
            if not power.gains:
                print(f"vanilla did not gain clear of zero at {study.steps} steps: raise --steps, rerun the pilot")
                return 1
        elif args.command == "run":
            result = run_study(study, args.jobs, args.threads)
            print(
                f"{len(result.done)} runs finished, {len(result.skipped)} already done, "
                f"{len(result.failed)} failed, in {result.wall_s / 60:.1f} min"
            )
            for failure in result.failed:
                print(f"FAILED {failure}")
            if result.failed:
                return 1
        else:
            print(write_report(study, doc=args.doc, figures=args.figures))
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
