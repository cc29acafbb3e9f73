"""What the command line says and returns when Ctrl-C stops it.

A module of its own, importing nothing heavy, so ``python -m engine`` can say the
same while MLX and the CLI are still being imported.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130  # the shell's status for a command Ctrl-C stopped


def interrupted() -> int:
    """Say that Ctrl-C stopped the command (on stderr); the status to exit with."""
    print("Interrupted.", file=sys.stderr)
    return INTERRUPTED
