#!/usr/bin/env bash
# The one script a session with a lent GPU runs: environment, GPU correctness, kernel
# benchmarks at issue 2's target shape, and the trainer's dry run of the paper's MoE recipe.
#
#   bash bench/device_check.sh            # on the GPU machine (stage limits sum to 15 minutes)
#   bash bench/device_check.sh --smoke    # tiny shapes, any machine (tests/bench runs this)
#
# Everything goes to $OUT if set, else bench/results/: the benchmark JSON, one log per stage
# in device_check/, and device_check/summary.json (per stage: exit code, seconds, timed out).
# Every stage has its own timeout and a failing stage does not stop the next one.
# Wheels found in .whl/ (carried with the tree) are unpacked into a private directory on the
# path (pure-Python wheels need no pip for that): how Liger and pytest reach a machine with no
# internet.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
case "${1:-}" in
  --smoke) SMOKE=1 ;;
  "") ;;
  *) echo "usage: bash bench/device_check.sh [--smoke]" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-bench/results}
LOGS="$OUT_DIR/device_check"
DEPS="$PWD/.device_deps"
mkdir -p "$LOGS"
: > "$LOGS/stages.jsonl"
# The tree is not pip-installed on the device: put both packages (osvl, osvl_kernels) on the path.
export PYTHONPATH="$PWD:$PWD/kernels:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export OUT="$OUT_DIR"

# stage NAME LIMIT_SECONDS COMMAND...: runs with a hard timeout, logs, records the outcome.
stage() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local timed_out=false
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
  printf '{"stage": "%s", "rc": %d, "seconds": %d, "timed_out": %s, "log": "%s"}\n' \
    "$name" "$rc" "$took" "$timed_out" "$LOGS/$name.log" >> "$LOGS/stages.jsonl"
  tail -n 15 "$LOGS/$name.log"
  echo "== $name: rc=$rc in ${took}s"
}

skip() {
  printf '{"stage": "%s", "rc": null, "seconds": 0, "timed_out": false, "skipped": "%s"}\n' "$1" "$2" >> "$LOGS/stages.jsonl"
  echo "== $1: skipped ($2)"
}

# --- 1. environment -------------------------------------------------------------------------
stage environment 60 "$PY" -c '
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
import triton; print("triton", triton.__version__)
'
if command -v nvidia-smi > /dev/null; then stage nvidia_smi 30 nvidia-smi; fi

# --- 2. carried wheels (Liger, pytest, ...) --------------------------------------------------
if compgen -G ".whl/*.whl" > /dev/null; then
  stage wheels 120 "$PY" -c '
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
    print("unpacked", wheel)
' "$DEPS" .whl/*.whl
else
  skip wheels "no .whl/ directory: Liger cases will be reported unavailable"
fi

# --- 3. GPU correctness: compiled Triton kernels (interpreter off) ---------------------------
if ! "$PY" -c "import pytest" 2> /dev/null; then
  skip gpu_tests "pytest not importable (carry its wheels in .whl/, see bench/README.md)"
elif [ "$SMOKE" -eq 1 ]; then
  stage gpu_tests 120 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/bench/test_measure.py
else
  # `-m gpu`: every GPU-marked test. tests/kernels needs hypothesis at import time.
  DIRS="tests/bench"
  if "$PY" -c "import hypothesis" 2> /dev/null; then DIRS="tests/kernels tests/bench"; fi
  stage gpu_tests 180 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m gpu $DIRS
fi

# --- 4. kernel benchmarks at the issue's target shape (T=16384, V=151936, H=4096, bf16) --------
if [ "$SMOKE" -eq 1 ]; then
  stage bench_grpo_loss 120 "$PY" bench/kernels/bench_grpo_loss.py --tokens 64 --vocab 128 --hidden 16 \
    --seqs 4 --warmup 1 --reps 1 --no-cpu-memory --cases osvl_grpo_loss,torch_eager \
    --name device_check_smoke --out-dir "$OUT_DIR"
else
  stage bench_grpo_loss 270 "$PY" bench/kernels/bench_grpo_loss.py --out-dir "$OUT_DIR"
fi

# --- 4b. fused-linear peak memory vs Liger at the real shape (max_memory_allocated) + dW error ---
if [ "$SMOKE" -eq 1 ]; then
  stage bench_linear_memory 120 "$PY" bench/kernels/bench_linear_memory.py --scale 128 --numerics-tokens 256 \
    --name device_check_linear_memory_smoke --out-dir "$OUT_DIR"
else
  stage bench_linear_memory 120 "$PY" bench/kernels/bench_linear_memory.py --out-dir "$OUT_DIR"
fi

# --- 5. trainer ----------------------------------------------------------------------------
# The recipe system and the dry-run memory planner of the paper's MoE recipe (seconds, no data).
# A real short GPU training step joins here once the demo pipeline (world -> SFT -> GRPO) exists.
stage train_dry_run 120 "$PY" -m osvl.train --recipe grpo_30b_moe --dry-run

# --- summary ---------------------------------------------------------------------------------
"$PY" - "$LOGS" <<'PYEOF'
import json, sys
from pathlib import Path
logs = Path(sys.argv[1])
stages = [json.loads(line) for line in (logs / "stages.jsonl").read_text().splitlines() if line.strip()]
failed = [s["stage"] for s in stages if s.get("rc") not in (None, 0)]
(logs / "summary.json").write_text(json.dumps({"stages": stages, "failed": failed}, indent=2) + "\n")
print("failed stages:", ", ".join(failed) if failed else "none")
sys.exit(1 if failed else 0)
PYEOF
