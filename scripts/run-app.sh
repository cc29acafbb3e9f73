#!/usr/bin/env bash
# Install (idempotent) and start Longleaf.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
exec .venv/bin/longleaf "$@"
