"""The one-page summary of a device check: every stage's outcome and every headline number against
the targets, from what the stages wrote so far (a cut-off run still summarises what it measured).

    python bench/device_summary.py OUT_DIR             # reads OUT_DIR/device_check/stages.jsonl and OUT_DIR/*.json
    python bench/device_summary.py OUT_DIR --returned  # OUT_DIR is what the GPU machine hands back: check its limits

Writes OUT_DIR/device_check/summary.json and summary.md; exits 1 when a stage failed, a result could not
be read, or (--returned) OUT_DIR holds what the GPU machine would not hand back.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from bench.kernels.report import TARGETS, ratio


@dataclass(frozen=True)
class ReturnLimits:
    """What the GPU machine hands back from $OUT (its device page); anything past them silently stays there."""

    files: int = 8
    levels: int = 2  # folders between $OUT and a file: $OUT/a/b/file comes back, $OUT/a/b/c/file does not
    file_bytes: int = 16 * 2**20
    total_bytes: int = 64 * 2**20
    name_pattern: str = r"[A-Za-z0-9._-]+"


def return_problems(out: Path, planned: list[Path], limits: ReturnLimits = ReturnLimits()) -> list[str]:
    """Every way `out` (with the `planned` files about to be written) breaks the return limits."""
    files = sorted({p for p in out.rglob("*") if not p.is_dir()} | set(planned))
    problems = []
    if len(files) > limits.files:
        problems.append(
            f"{len(files)} files, only {limits.files} come back: {[str(p.relative_to(out)) for p in files]}"
        )
    total = 0
    for path in files:
        parts = path.relative_to(out).parts
        if len(parts) - 1 > limits.levels:
            problems.append(f"{path.relative_to(out)}: {len(parts) - 1} folders down, at most {limits.levels}")
        if any(not re.fullmatch(limits.name_pattern, part) for part in parts):
            problems.append(f"{path.relative_to(out)}: names may hold only letters, digits, '.', '_' and '-'")
        if path.is_symlink():
            problems.append(f"{path.relative_to(out)}: a link, and links do not come back")
        size = path.stat().st_size if path.is_file() else 0
        total += size
        if size > limits.file_bytes:
            problems.append(f"{path.relative_to(out)}: {size} bytes, at most {limits.file_bytes}")
    if total > limits.total_bytes:
        problems.append(f"{total} bytes in all, at most {limits.total_bytes}")
    return problems


def latest(out: Path, prefix: str, unreadable: list[str]) -> dict | None:
    """The newest readable result JSON whose name starts with `prefix-` (the stage's --name); the names
    of those that do not parse go to `unreadable` (a summary must not die on one broken file)."""
    for path in sorted(out.glob(f"{prefix}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            return json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            unreadable.append(f"{path.name}: {error}")
    return None


def case(record: dict | None, name: str) -> dict:
    for c in (record or {}).get("cases", []):
        if c["name"] == name and c["status"] == "ok":
            return c
    return {}


def fmt(value, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}g}{unit}"


def judge(key: str, value: float | None, on_gpu: bool) -> str:
    """Targets are H200 numbers: judged on a GPU run only."""
    if key not in TARGETS or value is None or not on_gpu:
        return ""
    op, threshold = TARGETS[key]
    met = value >= threshold if op == ">=" else value <= threshold
    return "met" if met else "not met"


def shape_label(record: dict | None) -> str:
    s = (record or {}).get("shape")
    return f"T={s['num_tokens']} V={s['vocab']} H={s['hidden']} {s['dtype']}" if s else "not run"


def loop_rows(loop: dict | None) -> list[tuple[str, str, str, str]]:
    """The trainer's own loop on the device (bench/train_loop.py): its GRPO step split and rates."""
    s, c = (loop or {}).get("summary", {}), (loop or {}).get("config", {})
    label = (
        f"trainer loop, {c.get('preset')} width x {c.get('layers')} layers: SFT {c.get('sft_steps')} + "
        f"GRPO {c.get('grpo_steps')} steps (G={c.get('group_size')}), GRPO step"
        if loop
        else "trainer loop (not run)"
    )

    def pct(value):
        return None if value is None else 100 * value

    return [
        (label, fmt(s.get("grpo_step_time_s"), " s"), "", ""),
        (
            "  rollout / update / weight sync",
            " / ".join(fmt(s.get(f"grpo_time_{k}_s"), " s") for k in ("rollout", "update", "sync")),
            "",
            "",
        ),
        ("  rollout tokens/s (engine)", fmt(s.get("grpo_rollout_tokens_per_s"), "", 4), "", ""),
        ("  trainer tokens/s (GRPO update)", fmt(s.get("grpo_trainer_tokens_per_s"), "", 4), "", ""),
        (
            "  MFU (GRPO step, SFT step)",
            f"{fmt(pct(s.get('grpo_mfu')), ' %')}, {fmt(pct(s.get('sft_mfu')), ' %')}",
            "",
            "",
        ),
        (
            "  peak device / host memory",
            f"{fmt(s.get('peak_device_gib'), ' GiB')} / {fmt(s.get('peak_host_gib'), ' GiB')}",
            "",
            "",
        ),
        ("  tool calls per rollout", fmt(s.get("grpo_tool_calls_mean")), "", ""),
    ]


def rows(logits: dict | None, linear: dict | None, train: dict | None) -> list[tuple[str, str, str, str]]:
    """(number, value, target, verdict) for every headline the stages produce."""
    ours, liger = case(logits, "osvl_grpo_loss"), case(logits, "liger_grpo_loss_same_rows")
    lin, lin_liger = case(linear, "osvl_linear_grpo_loss"), case(linear, "liger_fused_linear_grpo")
    on_gpu = any((r or {}).get("device", {}).get("type") == "cuda" for r in (logits, linear))
    pct = ours.get("percent_of_floor")
    speedup = ratio(lin_liger.get("median_ms"), lin.get("median_ms"))
    memory = ratio(lin.get("peak_extra_bytes"), lin_liger.get("peak_extra_bytes"))
    bandwidth = (logits or {}).get("device", {}).get("peak", {}).get("tbps")
    achieved_tbps = ours["achieved_tbps_kernel_traffic_model"] * 4 / 3 if ours else None  # 4·T·V bytes / time
    summary = (train or {}).get("summary", {})
    config, model = (train or {}).get("config", {}), (train or {}).get("model", {})
    train_label = (
        f"train step, {config.get('preset')} width x {model.get('decoder_layers')} layers, "
        f"{(train or {}).get('batch', {}).get('tokens')} tokens + images, AC {config.get('activation_checkpoint')}"
        if train
        else "train step (not run)"
    )
    return [
        (f"grpo_loss fwd+bwd, {shape_label(logits)}", fmt(ours.get("median_ms"), " ms"), "", ""),
        ("  Liger Triton GRPO (same rows)", fmt(liger.get("median_ms"), " ms"), "", ""),
        (
            "  time ratio vs Liger (same rows)",
            fmt(ours.get("time_ratio_vs", {}).get("liger_grpo_loss_same_rows")),
            "< 1",
            "",
        ),
        (
            "  4·T·V bytes / time, TB/s (% of HBM peak)",
            f"{fmt(achieved_tbps)} ({fmt(pct, ' %')} of {fmt(bandwidth)} TB/s)",
            ">= 85 %",
            judge("logits_percent_of_issue_floor", pct, on_gpu),
        ),
        (f"linear_grpo_loss fwd+bwd, {shape_label(linear)}", fmt(lin.get("median_ms"), " ms"), "", ""),
        ("  Liger fused-linear GRPO", fmt(lin_liger.get("median_ms"), " ms"), "", ""),
        (
            "  speedup vs Liger",
            fmt(speedup, "x"),
            ">= 1.3x",
            judge("linear_speedup_vs_liger_fused_linear", speedup, on_gpu),
        ),
        (
            "  peak memory vs Liger (max_memory_allocated)",
            fmt(memory, "x"),
            "<= 0.25x",
            judge("linear_peak_memory_ratio_vs_liger_fused_linear", memory, on_gpu),
        ),
        ("  measured matmul rate [T,H]x[H,V]", fmt((linear or {}).get("matmul", {}).get("tflops"), " TFLOP/s"), "", ""),
        ("  % of the 6·T·H·V floor at that rate", fmt(lin.get("percent_of_measured_matmul_floor"), " %"), "", ""),
        (train_label, fmt(summary.get("step_s"), " s"), "", ""),
        ("  tokens/s", fmt(summary.get("tokens_per_s"), "", 4), "", ""),
        ("  MFU", fmt(None if summary.get("mfu") is None else 100 * summary["mfu"], " %"), "", ""),
        ("  peak memory", fmt(summary.get("peak_memory_gib"), " GiB"), "", ""),
        (
            "  time share of the loss",
            fmt(None if summary.get("loss_time_share") is None else 100 * summary["loss_time_share"], " %"),
            "",
            "",
        ),
    ]


def write_summary(out: Path, returned: bool = False) -> dict:
    """`returned`: `out` is the folder the GPU machine hands back, so its limits are checked too."""
    logs = out / "device_check"
    logs.mkdir(parents=True, exist_ok=True)
    stages_file = logs / "stages.jsonl"
    stages = (
        [json.loads(line) for line in stages_file.read_text().splitlines() if line.strip()]
        if stages_file.is_file()
        else []
    )
    failed = [s["stage"] for s in stages if s.get("rc") not in (None, 0)]
    unreadable: list[str] = []
    logits, linear, loop, train = (
        latest(out, name, unreadable)
        for name in ("device_logits", "device_linear", "device_train_loop", "device_train_step")
    )
    table = rows(logits, linear, train) + loop_rows(loop)
    env = next((r for r in (logits, train, linear, loop) if r), {})
    written = [logs / "summary.json", logs / "summary.md"]
    summary = {
        "stages": stages,
        "failed": failed,
        "unreadable_results": unreadable,
        "return_problems": return_problems(out, written) if returned else None,
        "git": env.get("git"),
        "device": env.get("device"),
        "versions": env.get("versions"),
        "table": [dict(zip(("number", "value", "target", "verdict"), r)) for r in table],
    }
    (logs / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# Device check: {(env.get('device') or {}).get('name', '?')}, "
        f"commit {(env.get('git') or {}).get('short', '?')}",
        "",
        f"versions: {json.dumps(env.get('versions'))}",
        "",
        "| stage | rc | seconds | limit | timed out |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['stage']} | {s.get('rc')} | {s.get('seconds')} | {s.get('limit', '')} | "
        f"{s.get('timed_out') or s.get('skipped', '')} |"
        for s in stages
    ]
    lines += ["", "| number | value | target | verdict |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table]
    lines += [f"\nunreadable result: {u}" for u in unreadable]
    lines += [f"\nwould not come back from the GPU machine: {p}" for p in summary["return_problems"] or []]
    (logs / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--returned", action="store_true", help="OUT_DIR is what the GPU machine hands back")
    args = parser.parse_args(argv)
    summary = write_summary(args.out_dir, returned=args.returned)
    print((args.out_dir / "device_check" / "summary.md").read_text())
    return 1 if summary["failed"] or summary["unreadable_results"] or summary["return_problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
