#!/usr/bin/env bash
# Downloads, on a machine with PyPI, exactly the wheels the GPU machine lacks, for its Python 3.12 on
# manylinux x86_64, into the git-ignored .whl/ that is copied to the GPU machine with the tree. The GPU
# image has torch 2.11 (CUDA 13) and triton 3.6 and nothing else we need; device_check.sh installs
# these offline (pip --no-index --find-links .whl) into a private target. Prints the total size,
# which must stay within WHEELS_MAX_MIB (40): the whole tree that travels is capped at 64 MiB.
#
#   bash bench/device_wheels.sh            # then, there: OSVL_COMMIT=<sha> bash bench/device_check.sh
#
# What each wheel is for (everything else torchtitan and Liger declare is never imported on the
# paths the device check runs: datasets, tensorboard, wandb, torchdata, tokenizers' CLI, ...):
#   torchtitan + tyro, docstring-parser, typeguard, einops, spmd_types   the model and its parallel plan
#   liger-kernel                                                         the benchmark baseline
#   numpy, safetensors, tokenizers, httpx + httpcore, h11, anyio,        osvl.data / osvl.model imports
#     idna, certifi, sniffio
#   pytest, pluggy, iniconfig, packaging, pygments                        the gpu tests (none imports hypothesis)
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${WHEELS_DIR:-.whl}
MAX_MIB=${WHEELS_MAX_MIB:-40}
PY=${PYTHON:-python3}
WHEELS=(
  torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 einops==0.8.2 spmd_types==0.2.3
  liger-kernel==0.8.5
  numpy==2.3.5 safetensors==0.8.0 tokenizers==0.23.3
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1 sniffio==1.3.1
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.19.2
)

if [ "${1:-}" = "--list" ]; then printf '%s\n' "${WHEELS[@]}"; exit 0; fi
if [ $# -gt 0 ]; then echo "usage: bash bench/device_wheels.sh [--list]" >&2; exit 2; fi

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any "${WHEELS[@]}"

count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "device_wheels: expected ${#WHEELS[@]} wheels, got $count" >&2
  exit 1
fi
bytes=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "device_wheels: $count wheels, $bytes bytes (${mib} MiB) in $DEST"
if [ "$mib" -gt "$MAX_MIB" ]; then
  echo "device_wheels: ${mib} MiB exceeds the ${MAX_MIB} MiB budget" >&2
  exit 1
fi
