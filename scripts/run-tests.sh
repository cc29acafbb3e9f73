#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite, Qt offscreen.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
source scripts/env.sh
export QT_QPA_PLATFORM="${QT_QPA_PLATFORM:-offscreen}"
# Worker processes (pytest-xdist): two per core, at most four, or LONGLEAF_TEST_WORKERS.
# A worker keeps about half a core busy (much of the suite waits on Qt events,
# servers and launched ranks); past four, each holding MLX, Qt and the tiny models,
# they compete for memory more than they gain. Work-stealing evens out the long
# tests (a bundle build, fifty structured answers) at the end of the run.
cores=$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)')
workers="${LONGLEAF_TEST_WORKERS:-$(( 2 * cores < 4 ? 2 * cores : 4 ))}"
exec .venv/bin/python -m pytest -n "$workers" --dist worksteal "$@"
