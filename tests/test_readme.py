"""README.md is the front door: at most 200 lines, opening with `make demo` and `make test`, and every
command in its bash blocks is run by a test named here, so none can rot. `make demo` and `make test` are
the Makefile's targets (a fresh machine and CI run them); the commands that need a cluster or a GPU are
compared with the commands osvl itself prints for them, and everything the CPU can run, runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block: continuation lines joined, comments and blank lines dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```$", text, re.M | re.S)
    out = []
    for block in blocks:
        commands: list[str] = []
        pending = ""
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$|^#.*$", "", line).strip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            if pending + line:
                commands.append(pending + line)
            pending = ""
        out.append(commands)
    return out


def readme_commands() -> list[str]:
    return [command for block in bash_blocks(README.read_text(encoding="utf-8")) for command in block]


def command_starting(prefix: str) -> str:
    [command] = [c for c in readme_commands() if c.startswith(prefix)]
    return command


# Every README command and the test of this module that exercises it.
EXERCISED = {
    "make demo": "test_make_demo_and_make_test_are_the_makefile_targets",
    "make test": "test_make_demo_and_make_test_are_the_makefile_targets",
    "python -m osvl.serve --recipe grpo_30b_moe": "test_serve_prints_every_node_and_the_readme_trainer_line",
    "python -m osvl.train --recipe grpo_30b_moe $SETS --dry-run": "test_the_dry_run_plans_the_printed_cluster",
    "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun": "test_serve_prints_every_node_and_the_readme_trainer_line",
    "make bench-cpu": "test_make_bench_cpu_writes_every_case",
    "bash bench/device_check.sh --dry-run": "test_the_device_check_plan_and_its_gpu_call",
    "OSVL_COMMIT=$(git rev-parse HEAD) bash bench/device_check.sh": "test_the_device_check_plan_and_its_gpu_call",
    "python -m bench.profile": "test_profile_writes_a_trace_and_a_breakdown",
    "python examples/trl_grpo.py": "test_the_trl_example",
    "python examples/verl_grpo.py": "test_the_verl_and_torchtitan_examples",
    "python examples/torchtitan_grpo.py": "test_the_verl_and_torchtitan_examples",
}


def test_the_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    assert text.startswith("# osvl\n\n```bash\n")
    assert bash_blocks(text)[0] == ["make demo", "make test"]


def test_what_the_two_commands_show_is_dated_and_pinned_to_a_commit():
    section = README.read_text(encoding="utf-8").split("## What the two commands show\n", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"^- ", section.strip(), flags=re.M)[1:]
    assert [item.split(":", 1)[0] for item in items] == ["`make demo`", "`make test`"]
    for item in items:
        assert re.search(r"\b[0-9a-f]{7}\b", item) and re.search(r"\b20\d\d-\d\d-\d\d\b", item), item


def test_every_readme_command_is_exercised_here():
    commands = readme_commands()
    unmatched = [c for c in commands if not any(c.startswith(prefix) for prefix in EXERCISED)]
    assert not unmatched, f"README commands no test runs: {unmatched}"
    stale = [prefix for prefix in EXERCISED if not any(c.startswith(prefix) for c in commands)]
    assert not stale, f"exercised commands the README no longer has: {stale}"
    missing = sorted(set(EXERCISED.values()) - set(globals()))
    assert not missing, missing


def test_the_command_reader_joins_lines_and_drops_comments():
    text = "```bash\n# a comment\nrun a \\\n    --b c   # why\n\nrun d\n```\n```python\nx\n```\n"
    assert bash_blocks(text) == [["run a --b c", "run d"]]


def test_make_demo_and_make_test_are_the_makefile_targets():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    # the clock starts before the install; the demo takes the runtime install, the tests all of it
    assert re.search(r"^demo: demo-clock install-runtime$", makefile, re.M)
    assert re.search(r"^test: install", makefile, re.M)
    assert re.search(r"^install: install-runtime ", makefile, re.M)
    runtime = re.search(r"^\$\(VENV\)/\.runtime:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "[test]" not in runtime and "test-no-deps" not in runtime
    assert (ROOT / ".ci" / "run").read_text(encoding="utf-8").count("make test")


def _printed_trainer_lines(capsys) -> list[str]:
    from osvl.serve.__main__ import main

    argv = shlex.split(command_starting("python -m osvl.serve "))[3:]
    assert main(argv) == 0
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if " torchrun " in f" {line}"]


def _sets(trainer_line: str) -> str:
    return trainer_line.split(" --recipe grpo_30b_moe ", 1)[1]


def test_serve_prints_every_node_and_the_readme_trainer_line(capsys):
    lines = _printed_trainer_lines(capsys)
    assert len(lines) == 8
    readme = command_starting("CUDA_VISIBLE_DEVICES=")
    sets = _sets(lines[0])
    assert "--set job.world_size=32" in sets and "--set 'tools.servers=" in sets
    for rank, printed in enumerate(lines):
        assert _sets(printed) == sets  # every node gets the same overrides
        assert readme.replace("$NODE_RANK", str(rank)).replace("$SETS", sets) == printed


@pytest.mark.slow
def test_the_dry_run_plans_the_printed_cluster(capsys):
    from osvl.train import main

    sets = _sets(_printed_trainer_lines(capsys)[0])
    argv = shlex.split(command_starting("python -m osvl.train ").replace("$SETS", sets))[3:]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "world 32 = dp_shard 32" in out and "fits: yes" in out
    assert "serving: 8 SGLang server(s) x TP 4" in out and "weight sync:" in out


@pytest.mark.slow
def test_make_bench_cpu_writes_every_case(tmp_path):
    """`make bench-cpu`'s command, its JSON sent to a temporary directory."""
    assert command_starting("make bench-cpu") == "make bench-cpu"
    recipe = re.search(r"^bench-cpu: install\n\t(.+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    argv = shlex.split(recipe.group(1).replace("$(BIN)/python", sys.executable))
    assert argv[1:] == ["bench/kernels/bench_grpo_loss.py", "--device", "cpu"]
    proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [path] = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert record["complete"] is True
    statuses = {case["name"]: case["status"] for case in record["cases"]}
    assert statuses["osvl_grpo_loss"] == statuses["osvl_linear_grpo_loss"] == "ok", statuses


def test_the_device_check_plan_and_its_gpu_call(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    argv = shlex.split(command_starting("bash bench/device_check.sh --dry-run"))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [printed] = re.findall(r"^(OSVL_COMMIT=\S+ bash bench/device_check\.sh)$", proc.stdout, re.M)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    gpu_call = command_starting("OSVL_COMMIT=")
    assert gpu_call.replace("$(git rev-parse HEAD)", head.stdout.strip()) == printed


@pytest.mark.slow
def test_profile_writes_a_trace_and_a_breakdown(tmp_path):
    """The README's profile command on the test's tiny data (the README runs it after `make demo`)."""
    from bench.profile import main
    from tests.trainer.fixtures import sft_overrides

    argv = shlex.split(command_starting("python -m bench.profile"))[3:]
    argv[argv.index("--out") + 1] = str(tmp_path / "profile")
    data = [o for o in sft_overrides(tmp_path / "data", tmp_path / "unused") if not o.startswith("job.run_dir")]
    # 8 trajectories are 2 steps an epoch at tiny_sft's global batch: two epochs hold the README's 3 steps
    sets = [x for o in [*data, "sft.epochs=2", "metrics.tensorboard=false"] for x in ("--set", o)]
    assert main(argv + sets) == 0
    assert (tmp_path / "profile" / "trace.json").is_file()
    rows = json.loads((tmp_path / "profile" / "breakdown.json").read_text())["rows"]
    assert [row["step"] for row in rows] == list(range(1, int(argv[argv.index("--steps") + 1]) + 1))


def _example_main(command: str):
    path = shlex.split(command)[1]
    assert path.startswith("examples/") and len(shlex.split(command)) == 2, command  # the README passes no flags
    module = __import__(path.removesuffix(".py").replace("/", "."), fromlist=["main"])
    return module.main([])


def test_the_verl_and_torchtitan_examples():
    verl = _example_main(command_starting("python examples/verl_grpo.py"))
    assert abs(float(verl["fused_loss"]) - float(verl["verl_loss"])) < 1e-5
    titan = _example_main(command_starting("python examples/torchtitan_grpo.py"))
    assert abs(float(titan["chunked"]["loss"]) - float(titan["whole"]["loss"])) < 1e-5


@pytest.mark.slow
def test_the_trl_example(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the example writes its run
    result = _example_main(command_starting("python examples/trl_grpo.py"))
    assert result["trainer"].state.global_step == 2
