#!/usr/bin/env bash
# Install (idempotent) and start Longleaf.
set -euo pipefail
# The checkout, named without leaving the folder this was run from: a model or
# file given by a relative path means the one there.
checkout="$(cd "$(dirname "$0")/.." && pwd)"
"$checkout/scripts/setup.sh"
source "$checkout/scripts/env.sh"
exec "$checkout/.venv/bin/longleaf" "$@"
