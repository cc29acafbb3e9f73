#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite, Qt offscreen.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
source scripts/env.sh
export QT_QPA_PLATFORM="${QT_QPA_PLATFORM:-offscreen}"
exec .venv/bin/python -m pytest "$@"
