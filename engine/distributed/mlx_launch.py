"""MLX's launcher, ``mlx.launch``, run as ``python -m engine.distributed.mlx_launch``.

Its console script stands beside a venv's Python but not inside a bundled app,
whose executable runs modules (``-m``) and nothing else: starting the launcher
as a module works in both.
"""

from __future__ import annotations

import sys

from mlx._distributed_utils.launch import main

if __name__ == "__main__":
    sys.exit(main())
