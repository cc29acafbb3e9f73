"""What a model's KV cache costs at its full context, in each mode, on this machine.

The one rule behind "262k in q6: 6.1 GB — fits" for a model on disk and a
recommended one alike: ``kvquant.project_kv_bytes`` at the model's context, plus
its weights, against the machine's RAM after the memory guard's headroom.
Arithmetic only; nothing here calls MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from engine.cache.modes import MODES
from engine.errors import UnsupportedModeError
from engine.memory.guard import default_headroom


@dataclass(frozen=True)
class ModeCost:
    """One KV mode at a model's full context.

    Attributes:
        mode: the KV mode.
        kv_bytes: KV bytes at full context (None: the mode cannot store this head size).
        fits: weights plus those KV bytes fit this machine's RAM after the headroom.
    """

    mode: str
    kv_bytes: int | None
    fits: bool


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
        costs.append(ModeCost(mode, kv, kv <= room))
    return tuple(costs)
