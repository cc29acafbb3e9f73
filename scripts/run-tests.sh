#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite, Qt offscreen.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
source scripts/env.sh
export QT_QPA_PLATFORM="${QT_QPA_PLATFORM:-offscreen}"
# Worker processes (pytest-xdist): one per core, at most four, or LONGLEAF_TEST_WORKERS.
# Much of the suite waits on Qt events, servers and launched ranks, which the other
# worker fills; past four, each holding MLX, Qt and the tiny models, they compete for
# memory more than they gain. Each worker's BLAS keeps to one thread: OpenBLAS's idle
# threads spin, and two workers' spinning took a fifth of the cores (measured on a
# 2-core machine). Work-stealing evens out the long tests at the end of the run.
cores=$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)')
workers="${LONGLEAF_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
if (( workers > 1 )); then
    export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist worksteal "$@"
