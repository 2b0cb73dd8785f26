#!/usr/bin/env bash
# Rehearses the GPU machine's device check on a CPU machine, so its one try is not spent on what a CPU
# can find: the GPU image's Python stack (Python 3.12, torch 2.11's CUDA 13 build from PyPI, triton
# 3.6, the image's packages that the check imports; no torchtitan, no Liger), the wheels
# bench/device_wheels.sh carries, installed as the check installs them, a copy of the tree without
# .git (as the device tool sends it) on a PATH without git, then
#   1. bench/device_check.sh --smoke, with OSVL_COMMIT as bench/README.md's call passes it, and the
#      checks of what it left in $OUT (what the GPU machine hands back, the commit, the versions);
#   2. the varlen attention path (tests/model/test_attention.py: fake CUDA tensors against torch
#      2.11's own varlen_attn) and the collection of the gpu-marked tests, under the carried pytest.
#
#   bash bench/device_sim.sh     # ~5 GB of downloads the first time; kept in .device-sim/ (git-ignored)
#
# Not in `make test` (the CUDA build is ~5 GB). DEVICE_SIM_PYTHON names a Python 3.12 (default
# python3.12); DEVICE_SIM_DIR moves .device-sim/. Exits 0 only when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SIM=${DEVICE_SIM_DIR:-$REPO/.device-sim}
PY312=${DEVICE_SIM_PYTHON:-python3.12}
# The image's packages the check imports (the rest of the image cannot change its outcome), pinned:
# at the versions the device page lists (torch, triton, numpy, safetensors, tokenizers, pytest's
# plugins by name only), else at what PyPI gave on 2026-12-02. Their own dependencies come as pip
# resolves them. The carried wheels shadow the image's numpy, pytest, safetensors, tokenizers, httpx.
IMAGE_PACKAGES=(
  torch==2.11.0 triton==3.6.0 numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2 httpx==0.28.1
  opencv-python-headless==5.0.0.93 aiohttp==3.14.5 click==8.5.1 rich==15.0.0 tqdm==4.70.1
  pytest==9.2.0 pytest-benchmark==5.3.1 pytest-xdist==3.8.0 pytest-cov==7.1.0 pytest-mock==3.17.0
  pytest-timeout==2.4.0 hypothesis==6.170.17
)
START=$SECONDS
mkdir -p "$SIM"
exec > >(tee "$SIM/device_sim.log") 2>&1
step() { echo "== device_sim: $* ($((SECONDS - START))s)"; }

if ! "$PY312" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2> /dev/null; then
  echo "device_sim: $PY312 is not a Python 3.12 (the GPU image's); set DEVICE_SIM_PYTHON" >&2
  exit 2
fi

# --- the image's stack, built once per package list -------------------------------------------
VENV="$SIM/venv"
if [ "$(cat "$VENV/.image" 2> /dev/null)" != "${IMAGE_PACKAGES[*]}" ]; then
  step "building the image's stack in $VENV"
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --no-cache-dir "${IMAGE_PACKAGES[@]}"
  echo "${IMAGE_PACKAGES[*]}" > "$VENV/.image"
fi
"$VENV/bin/python" -c "
import importlib.util, sys, torch, triton
assert torch.__version__.startswith('2.11.0') and torch.version.cuda == '13.0', (torch.__version__, torch.version.cuda)
assert triton.__version__ == '3.6.0', triton.__version__
extra = [m for m in ('torchtitan', 'liger_kernel') if importlib.util.find_spec(m)]
assert not extra, f'the GPU image has no {extra}'
print('image stack: python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
"
"$VENV/bin/python" -m pip freeze --quiet | tr '\n' ' '
echo

# --- the carried wheels and the tree the device tool sends ---------------------------------------
step "carried wheels (bench/device_wheels.sh)"
bash bench/device_wheels.sh
step "the tree as the device tool sends it: tracked and untracked-not-ignored files and .whl, no .git"
TREE="$SIM/tree"
rm -rf "$TREE"
mkdir -p "$TREE"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
  | tar --null -T - -cf - | tar -xf - -C "$TREE"
cp -r .whl "$TREE/.whl"
tree_bytes=$(du -sb "$TREE" | cut -f1)
echo "tree: $tree_bytes bytes (the device tool carries at most $((64 * 1024 * 1024)))"
if [ "$tree_bytes" -gt $((64 * 1024 * 1024)) ]; then echo "device_sim: the tree would not travel" >&2; exit 1; fi
COMMIT=$(git rev-parse HEAD)
if ! git diff --quiet HEAD; then echo "device_sim: uncommitted changes travel too; the results name $COMMIT"; fi

# A PATH like the image's but without git: every command of the usual folders, git left out.
NOGIT="$SIM/nogit-bin"
rm -rf "$NOGIT"
mkdir -p "$NOGIT"
for dir in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
  for cmd in "$dir"/*; do
    name=${cmd##*/}
    if [ -x "$cmd" ] && [ ! -d "$cmd" ] && [[ $name != git* ]] && [ ! -e "$NOGIT/$name" ]; then ln -s "$cmd" "$NOGIT/$name"; fi
  done
done
SIM_PATH="$VENV/bin:$NOGIT"
if PATH=$SIM_PATH command -v git > /dev/null; then echo "device_sim: git is still on the PATH" >&2; exit 1; fi
# The device's environment: nothing of this shell's (no PYTHONPATH, no PYTHONUNBUFFERED, no pip config).
device_env=(env -i HOME="$HOME" PATH="$SIM_PATH" PIP_CONFIG_FILE=/dev/null)

# --- 1. the device check, smoke shapes; limits scaled for a loaded CPU host -----------------------
step "bash bench/device_check.sh --smoke in the tree, OSVL_COMMIT=$COMMIT"
OUT_DIR="$SIM/out"
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
check_rc=0
(cd "$TREE" && "${device_env[@]}" OUT="$OUT_DIR" OSVL_COMMIT="$COMMIT" \
  DEVICE_CHECK_LIMIT_PCT="${DEVICE_CHECK_LIMIT_PCT:-1000}" DEVICE_CHECK_BUDGET_S="${DEVICE_CHECK_BUDGET_S:-5000}" \
  bash bench/device_check.sh --smoke) || check_rc=$?
echo "device_check.sh exit status: $check_rc"
step "what the device check left in \$OUT"
(cd "$REPO" && "$VENV/bin/python" - "$OUT_DIR" "$COMMIT" "$check_rc" << 'EOF'
import json, sys
from pathlib import Path

from bench.device_summary import return_problems

out, commit, rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
print(f"$OUT: {len(files)} files: {files}")
summary = json.loads((out / "device_check" / "summary.json").read_text())
stages = {s["stage"]: s for s in summary["stages"]}
results = {p.name: json.loads(p.read_text()) for p in out.glob("device_*.json")}
checks = {
    "device_check.sh exited 0": rc == 0,
    "every stage ran and passed (wheels installed, not skipped)": len(stages) == 7
    and all(s.get("rc") == 0 for s in stages.values()),
    "$OUT within the return limits": return_problems(out, []) == [] and summary["return_problems"] == [],
    "four results, each naming the commit from OSVL_COMMIT": len(results) == 4
    and all(r["git"] == {"commit": commit, "short": commit[:8], "dirty": None, "source": "OSVL_COMMIT"}
            for r in results.values()),
    "results measured on Python 3.12, torch 2.11, triton 3.6, the carried Liger": all(
        r["versions"]["python"].startswith("3.12.") and r["versions"]["torch"].startswith("2.11.0")
        and r["versions"]["triton"] == "3.6.0" and r["versions"]["liger_kernel"] == "0.8.5"
        for r in results.values()),
}
for name, ok in checks.items():
    print(("PASS " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
EOF
) || { echo "device_sim: FAILED (the device check; log: $OUT_DIR/device_check/run.log)"; exit 1; }

# --- 2. the varlen attention path and the gpu tests' collection, under the carried pytest --------
step "varlen attention on torch 2.11 (fake CUDA tensors) and the gpu-marked tests, carried wheels"
DEPS="$SIM/deps"
rm -rf "$DEPS"
"${device_env[@]}" python3 -m pip install --quiet --no-index --find-links "$TREE/.whl" --no-deps --target "$DEPS" \
  "$TREE"/.whl/*.whl
GPU_FILES=$(cd "$TREE" && grep -rl --include='test_*.py' "pytest.mark.gpu" tests | sort)
(cd "$TREE" && "${device_env[@]}" PYTHONPATH="$TREE:$TREE/kernels:$DEPS" TRITON_INTERPRET=1 \
  python3 -m pytest -v -p no:cacheprovider tests/model/test_attention.py) \
  || { echo "device_sim: FAILED (varlen attention)"; exit 1; }
# shellcheck disable=SC2086  # one path per word
(cd "$TREE" && "${device_env[@]}" PYTHONPATH="$TREE:$TREE/kernels:$DEPS" TRITON_INTERPRET=0 \
  python3 -m pytest -q -p no:cacheprovider -m gpu $GPU_FILES) \
  || { echo "device_sim: FAILED (gpu-marked tests)"; exit 1; }
rm -rf "$DEPS"
echo "device_sim: passed in $((SECONDS - START))s (commit $COMMIT; log: $SIM/device_sim.log)"
