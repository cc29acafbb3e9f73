"""The KV storage modes, best quality first.

Its own module, free of MLX, so front ends can list the modes (settings, menus)
without loading MLX; ``kvquant`` holds each mode's storage facts.
"""

from __future__ import annotations

MODES: tuple[str, ...] = ("fp16", "q8", "q6", "q4")
DEFAULT_MODE = "q8"
