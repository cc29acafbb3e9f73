"""What a model's KV cache costs at its full context, in each mode, on this machine.

The one rule behind "262k in q6: 6.1 GB — fits" for a model on disk and a
recommended one alike: ``kvquant.project_kv_bytes`` at the model's context, plus
its weights, against the machine's RAM after the memory guard's headroom.
Arithmetic only; nothing here calls MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from engine.cache.modes import MODES, KvMode
from engine.errors import UnsupportedModeError
from engine.memory.guard import default_headroom

FIT_STEP = 1024  # tokens: "fits up to 120k" needs no finer grain


@dataclass(frozen=True)
class ModeCost:
    """One KV mode at a model's full context.

    Attributes:
        mode: the KV mode.
        kv_bytes: KV bytes at full context (None: the mode cannot store this head size).
        fits: weights plus those KV bytes fit this machine's RAM after the headroom.
        tokens_fit: the most tokens of context whose KV fits beside the weights in
            this mode, at most the full context, in whole steps of ``FIT_STEP``
            (0: none, or the mode cannot store this head size).
    """

    mode: KvMode
    kv_bytes: int | None
    fits: bool
    tokens_fit: int = 0


def full_context_costs(
    *,
    attention_layers: int,
    kv_heads: int,
    head_dim: int,
    max_context: int,
    weights_bytes: int,
    total_ram_bytes: int | None = None,
) -> tuple[ModeCost, ...]:
    """Each mode's KV bytes at ``max_context`` and whether the model then fits in RAM.

    Args:
        attention_layers: layers whose KV cache grows with the context.
        kv_heads: KV heads per attention layer.
        head_dim: width of one KV head.
        max_context: tokens of context.
        weights_bytes: the model's weights (its size on disk is close enough).
        total_ram_bytes: the machine's RAM; None reads it now.
    """
    from engine.cache.kvquant import project_kv_bytes  # compiles nothing on import

    total = psutil.virtual_memory().total if total_ram_bytes is None else total_ram_bytes
    room = total - default_headroom(total) - weights_bytes
    costs = []
    for mode in MODES:
        try:
            kv = project_kv_bytes(attention_layers, kv_heads, head_dim, max_context, mode)
        except (UnsupportedModeError, ValueError):
            costs.append(ModeCost(mode, None, False))
            continue
        fit = max_context if kv <= room else _tokens_that_fit(
            room, attention_layers, kv_heads, head_dim, max_context, mode)
        costs.append(ModeCost(mode, kv, kv <= room, fit))
    return tuple(costs)


def _tokens_that_fit(room: int, attention_layers: int, kv_heads: int, head_dim: int,
                     max_context: int, mode: KvMode) -> int:
    """Whole ``FIT_STEP``s of context whose KV fits in ``room`` bytes (a bisection)."""
    from engine.cache.kvquant import project_kv_bytes

    low, high = 0, max_context // FIT_STEP  # in steps; ``low`` always fits
    while low < high:
        middle = (low + high + 1) // 2
        kv = project_kv_bytes(attention_layers, kv_heads, head_dim, middle * FIT_STEP, mode)
        low, high = (middle, high) if kv <= room else (low, middle - 1)
    return low * FIT_STEP
