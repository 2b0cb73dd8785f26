#!/usr/bin/env bash
# Every GPU number in one run of <= 285 s on a GPU machine without internet, short enough that a failed
# run can be fixed and rerun within a quarter hour of GPU time (bench/README.md has the steps).
#
#   OSVL_COMMIT=<sha> bash bench/device_check.sh   # on the GPU machine, the tree copied there with .whl/
#   bash bench/device_check.sh --dry-run           # print the stage plan and time budget, run nothing
#   bash bench/device_check.sh --smoke             # tiny shapes, any machine (tests/bench runs this on CPU)
#
# Stages run in priority order, each under its own limit, and never past the total budget
# (DEVICE_CHECK_BUDGET_S, default 270 s: a stage that cannot get its minimum is skipped, so the
# run ends in time even when stages hang). DEVICE_CHECK_LIMIT_PCT scales every stage's limit
# (default 100), for rehearsing the run on a slow or loaded CPU host. A stage killed by its limit
# gets SIGABRT first, so Python prints where it was (faulthandler) before it dies.
#
# What comes back from the GPU machine is at most 8 files of $OUT, so the run writes 8 and no more:
# the four result JSONs (each written whole, as it measures), and in device_check/ the one log of
# every stage (run.log, each stage's share capped), stages.jsonl (a line as each stage ends) and
# the summary (summary.json, summary.md: bench/device_summary.py, which checks those limits).
# The machine's copy of the tree has no .git: OSVL_COMMIT names the commit the results carry.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=full
case "${1:-}" in
  --smoke) MODE=smoke ;;
  --dry-run) MODE=dry ;;
  "") ;;
  *) echo "usage: bash bench/device_check.sh [--smoke | --dry-run]" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then echo "usage: bash bench/device_check.sh [--smoke | --dry-run]" >&2; exit 2; fi

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-bench/results}
SUMMARY_ARGS=()
if [ -n "${OUT:-}" ]; then SUMMARY_ARGS=(--returned); fi  # $OUT is what the GPU machine hands back
BUDGET=${DEVICE_CHECK_BUDGET_S:-270}
# The wall limit to give the run on the GPU machine: it covers budget + summary, and two such runs with a
# machine start (~2 min) before each fit in a quarter hour of GPU time, so a failed run can be rerun.
RUN_LIMIT_S=300
LIMIT_PCT=${DEVICE_CHECK_LIMIT_PCT:-100}  # stage limits in percent of the plan's (a slow CPU host rehearsing the run)
SUMMARY_RESERVE=15  # seconds kept for the summary at the end
KILL_GRACE=5        # SIGKILL this long after a stage's SIGABRT
STAGE_LOG_BYTES=$((2 * 1024 * 1024))  # each stage's share of run.log: 7 x 2 MiB stays under the 16 MiB a file may have
LOGS="$OUT_DIR/device_check"
LOG="$LOGS/run.log"
WHEELS=${DEVICE_CHECK_WHEELS:-.whl}

if [ -n "${OSVL_COMMIT:-}" ] && ! [[ "$OSVL_COMMIT" =~ ^[0-9a-f]{7,40}$ ]]; then
  echo "device_check: OSVL_COMMIT must be 7-40 lowercase hex digits (git rev-parse HEAD), got '$OSVL_COMMIT'" >&2
  exit 2
fi
if [ -z "${OSVL_COMMIT:-}" ] && ! git rev-parse HEAD > /dev/null 2>&1; then
  echo "device_check: no .git or no git here and no OSVL_COMMIT: the results will be named '-nogit'" >&2
fi

# name | limit (s) | minimum worth starting (s) | what it measures
PLAN=(
  "environment|30|10|torch / CUDA / triton versions, GPU name, nvidia-smi"
  "wheels|45|15|pip --no-index --find-links .whl into a private temp dir on PYTHONPATH (torchtitan, Liger, numpy, pytest, ...)"
  "gpu_tests|100|40|pytest -m gpu (the files with gpu-marked tests): the compiled Triton kernels against float64"
  "logits|70|30|grpo_loss fwd+bwd T=16384 V=151936 bf16 vs Liger's Triton GRPO; 4·T·V bytes, % of HBM"
  "linear|110|45|linear_grpo_loss H=4096 vs Liger's fused-linear GRPO: time, max_memory_allocated; 6·T·H·V at the measured matmul rate"
  "train_loop|100|45|the trainer's SFT + GRPO stages on the GPU (8B width, 2 layers, local engine, tool calls): step split, tokens/s, MFU, memory"
  "train_step|135|60|8B-width Qwen3-VL, 4 layers, 16k packed tokens with images, full AC: tokens/s, MFU, peak memory, loss share"
)

if [ "$MODE" = dry ]; then
  total=0
  printf '%-12s %7s %7s  %s\n' stage limit_s min_s what
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name limit minimum what <<< "$entry"
    printf '%-12s %7s %7s  %s\n' "$name" "$limit" "$minimum" "$what"
    total=$((total + limit + KILL_GRACE))
  done
  printf '%-12s %7s\n' summary "$SUMMARY_RESERVE"
  echo "sum of stage limits (with ${KILL_GRACE}s kill grace each): ${total}s; budget ${BUDGET}s (stages are cut to fit it);" \
       "summary reserve ${SUMMARY_RESERVE}s; wall <= $((BUDGET + SUMMARY_RESERVE))s"
  commit=$(git rev-parse HEAD 2> /dev/null || echo "<commit>")
  echo "on the GPU machine (this tree copied there with .whl/, after bash bench/device_wheels.sh here), limit ${RUN_LIMIT_S}s:"
  echo "OSVL_COMMIT=$commit bash bench/device_check.sh"
  if ! git diff --quiet HEAD 2> /dev/null; then
    echo "(the tree has uncommitted changes: they travel, but the results will name $commit)"
  fi
  exit 0
fi

# The carried wheels install into a private directory of this run, and whatever a stage writes on
# its own (its $OUT) stays in another: only this script writes into the $OUT that travels back.
SCRATCH=$(mktemp -d -t osvl_device_check.XXXXXX)
DEPS="$SCRATCH/deps"
trap 'rm -rf "$SCRATCH"' EXIT
mkdir -p "$DEPS" "$SCRATCH/out"
# The tree is not pip-installed on the device: both packages (osvl, osvl_kernels) and the carried
# wheels' private target go on the path. Unbuffered: a stage killed by its limit keeps its output.
export PYTHONPATH="$PWD:$PWD/kernels:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export OUT="$SCRATCH/out" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ulimit -c 0  # no core files from the SIGABRT of a stage past its limit

mkdir -p "$LOGS"
: > "$LOGS/stages.jsonl"
: > "$LOG"
START=$SECONDS

limit_of() {  # the plan's limit and minimum for a stage
  local entry
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name limit minimum _ <<< "$entry"
    if [ "$name" = "$1" ]; then echo "$((limit * LIMIT_PCT / 100)) $((minimum * LIMIT_PCT / 100))"; return; fi
  done
  echo "unknown stage $1" >&2; exit 2
}

record() {  # record NAME RC SECONDS LIMIT TIMED_OUT [SKIPPED_REASON]
  local skipped=${6:-}
  if [ -n "$skipped" ]; then
    printf '{"stage": "%s", "rc": null, "seconds": 0, "limit": %d, "timed_out": false, "skipped": "%s"}\n' \
      "$1" "$4" "$skipped" >> "$LOGS/stages.jsonl"
  else
    printf '{"stage": "%s", "rc": %d, "seconds": %d, "limit": %d, "timed_out": %s}\n' \
      "$1" "$2" "$3" "$4" "$5" >> "$LOGS/stages.jsonl"
  fi
}

skip() {
  read -r limit _ <<< "$(limit_of "$1")"
  record "$1" 0 0 "$limit" false "$2"
  echo "== $1: skipped ($2)" | tee -a "$LOG"
}

# cap_stage_log OFFSET: a stage's output past STAGE_LOG_BYTES keeps its first and last halves.
cap_stage_log() {
  local offset=$1 size
  size=$(($(stat -c %s "$LOG") - offset))
  if [ "$size" -le "$STAGE_LOG_BYTES" ]; then return; fi
  local half=$((STAGE_LOG_BYTES / 2))
  tail -c +$((offset + 1)) "$LOG" | head -c "$half" > "$SCRATCH/head"
  tail -c "$half" "$LOG" > "$SCRATCH/tail"
  truncate -s "$offset" "$LOG"
  { cat "$SCRATCH/head"; printf '\n[... %d bytes of output left out ...]\n' $((size - 2 * half)); cat "$SCRATCH/tail"; } >> "$LOG"
}

# stage NAME COMMAND...: runs under min(its limit, what is left of the budget), logs, records.
stage() {
  local name=$1; shift
  local limit minimum
  read -r limit minimum <<< "$(limit_of "$name")"
  local left=$((BUDGET - (SECONDS - START) - KILL_GRACE))
  if [ "$left" -lt "$minimum" ]; then
    skip "$name" "only ${left}s of the ${BUDGET}s budget left, needs ${minimum}s"
    return
  fi
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  local begin=$SECONDS
  echo "== $name (limit ${limit}s, $((SECONDS - START))s into the run)" | tee -a "$LOG"
  local offset
  offset=$(stat -c %s "$LOG")
  timeout --signal=ABRT --kill-after=$KILL_GRACE "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  local took=$((SECONDS - begin))
  local timed_out=false
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
  cap_stage_log "$offset"
  record "$name" "$rc" "$took" "$limit" "$timed_out"
  tail -c +$((offset + 1)) "$LOG" | tail -n 12
  echo "== $name: rc=$rc in ${took}s" | tee -a "$LOG"
}

# --- 1. environment -------------------------------------------------------------------------
stage environment bash -c '"$0" -c "
import platform, torch
print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda)
print(\"cuda available\", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(\"device\", torch.cuda.get_device_name(), p.total_memory // 2**30, \"GiB\", p.multi_processor_count, \"SMs\")
import triton; print(\"triton\", triton.__version__)
from pathlib import Path; from bench.kernels.report import git_info; print(\"commit\", git_info(Path.cwd()))
" || exit; if command -v nvidia-smi > /dev/null; then nvidia-smi; fi' "$PY"

# --- 2. carried wheels -----------------------------------------------------------------------
if compgen -G "$WHEELS/*.whl" > /dev/null && ! "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
  skip wheels "the carried wheels are for Python 3.12 (the GPU image); this Python is $("$PY" -V 2>&1)"
elif compgen -G "$WHEELS/*.whl" > /dev/null; then
  # pip offline into a private target (no index, no dependency resolution: .whl/ is the closure).
  # A Python without pip unpacks the wheels instead (pure-Python and manylinux wheels need no build).
  stage wheels bash -c '
    if "$0" -m pip --version > /dev/null 2>&1; then
      "$0" -m pip install --no-index --find-links "$2" --no-deps --target "$1" --upgrade --quiet "$2"/*.whl
    else
      "$0" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" "$1" "$2"/*.whl
    fi && ls "$1"' "$PY" "$DEPS" "$WHEELS"
else
  skip wheels "no wheels in $WHEELS/ (bash bench/device_wheels.sh): torchtitan and Liger stages will fail or be unavailable"
fi

# --- 3. GPU correctness: compiled Triton kernels (interpreter off) ---------------------------
if ! "$PY" -c "import pytest" 2> /dev/null; then
  skip gpu_tests "pytest not importable (copy its wheels to .whl/: bash bench/device_wheels.sh)"
elif [ "$MODE" = smoke ]; then
  stage gpu_tests env TRITON_INTERPRET=0 "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/bench/test_measure.py
else
  # Only the files that hold gpu-marked tests: collecting the whole suite would import every
  # integration (TRL, verl, OpenCV tools) the GPU image does not have, and cost a minute. -v names
  # each test as it starts, so a hung one is named in the log.
  GPU_FILES=$(grep -rl --include='test_*.py' "pytest.mark.gpu" tests | sort)
  stage gpu_tests env TRITON_INTERPRET=0 "$PY" -m pytest -v -p no:cacheprovider -m gpu $GPU_FILES
fi

# --- 4. grpo_loss at the target shape against Liger's Triton GRPO loss and the bytes floor ------
if [ "$MODE" = smoke ]; then
  stage logits "$PY" bench/kernels/bench_grpo_loss.py --tokens 64 --vocab 128 --hidden 16 --seqs 4 --warmup 1 --reps 1 \
    --no-cpu-memory --cases osvl_grpo_loss,torch_eager --name device_logits --out-dir "$OUT_DIR"
else
  stage logits "$PY" bench/kernels/bench_grpo_loss.py --interleave \
    --cases osvl_grpo_loss,liger_grpo_loss_same_rows,liger_grpo_loss_padded --name device_logits --out-dir "$OUT_DIR"
fi

# --- 5. linear_grpo_loss against Liger's fused-linear GRPO (time, memory, FLOP floor) -----------
if [ "$MODE" = smoke ]; then
  stage linear "$PY" bench/kernels/bench_grpo_loss.py --tokens 64 --vocab 128 --hidden 16 --seqs 4 --warmup 1 --reps 1 \
    --no-cpu-memory --matmul-rate --cases osvl_linear_grpo_loss,liger_fused_linear_grpo --name device_linear \
    --out-dir "$OUT_DIR"
else
  stage linear "$PY" bench/kernels/bench_grpo_loss.py --matmul-rate --reps 5 \
    --cases osvl_linear_grpo_loss,liger_fused_linear_grpo --name device_linear --out-dir "$OUT_DIR"
fi

# --- 6. the trainer's own loop: SFT steps, then GRPO steps with rollouts through the local engine ----
if [ "$MODE" = smoke ]; then
  stage train_loop "$PY" bench/train_loop.py --smoke --name device_train_loop --out-dir "$OUT_DIR"
else
  stage train_loop "$PY" bench/train_loop.py --name device_train_loop --out-dir "$OUT_DIR"
fi

# --- 7. one trainer step of an 8B-width Qwen3-VL cut to 4 decoder layers ------------------------
if [ "$MODE" = smoke ]; then
  stage train_step "$PY" bench/train_step.py --smoke --steps 2 --tokens 256 --name device_train_step --out-dir "$OUT_DIR"
else
  stage train_step "$PY" bench/train_step.py --name device_train_step --out-dir "$OUT_DIR"
fi

# --- summary ---------------------------------------------------------------------------------
timeout --kill-after=$KILL_GRACE $((SUMMARY_RESERVE - KILL_GRACE)) "$PY" -m bench.device_summary "$OUT_DIR" \
  ${SUMMARY_ARGS[@]+"${SUMMARY_ARGS[@]}"}
rc=$?
echo "device check: $((SECONDS - START))s wall"
exit $rc
