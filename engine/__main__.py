"""``python -m engine generate|models|info``: the headless CLI."""

from __future__ import annotations

import sys

from engine.interrupted import interrupted

if __name__ == "__main__":
    try:
        import mlx.core as mx

        from engine.cli import main
    except KeyboardInterrupt:  # Ctrl-C in the second the imports take: no traceback
        sys.exit(interrupted())
    status = main()
    # MLX needs each thread, the main one included, to drop its streams before
    # the interpreter shuts down, or the process may abort after a good run.
    mx.clear_streams()
    sys.exit(status)
