#!/usr/bin/env bash
# Install (idempotent) and start Longleaf.
set -euo pipefail
# The checkout, named without leaving the folder this was run from: a model or
# file given by a relative path means the one there.
# (CDPATH set: cd would print the folder it found, into the name.)
checkout="$(CDPATH='' cd -- "$(dirname -- "$0")/.." >/dev/null && pwd)"
"$checkout/scripts/setup.sh"
source "$checkout/scripts/env.sh"
exec "$checkout/.venv/bin/longleaf" "$@"
