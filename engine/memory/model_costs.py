"""What a model's KV cache costs at its full context, in each mode, on this machine.

The one rule behind "262k in q6: 6.1 GB — fits" for a model on disk and a
recommended one alike: ``kvquant.project_kv_bytes`` at the model's context, plus
its weights, what reading a conversation of that length keeps free beside the
pages (as the fit check does) and what its layers outside the pages reserve
(sliding windows, linear-attention state, with their checkpoints), against the
machine's RAM after the memory guard's headroom. Arithmetic only; nothing here
calls MLX.
"""

from __future__ import annotations

from collections.abc import Callable
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
        fits: weights plus those KV bytes and the reading reserve
            (:func:`reading_reserve`) fit this machine's RAM after the headroom.
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
    outside_pages_bytes: int = 0,
) -> tuple[ModeCost, ...]:
    """Each mode's KV bytes at ``max_context`` and whether the model then fits in RAM.

    Args:
        attention_layers: layers whose KV cache grows with the context.
        kv_heads: KV heads per attention layer.
        head_dim: width of one KV head.
        max_context: tokens of context.
        weights_bytes: the model's weights (its size on disk is close enough).
        total_ram_bytes: the machine's RAM; None reads it now.
        outside_pages_bytes: what one conversation's layers outside the pages
            reserve at any context (``engine.session.session.outside_pages_reserve``).
    """
    from engine.cache.kvquant import project_kv_bytes  # compiles nothing on import

    total = psutil.virtual_memory().total if total_ram_bytes is None else total_ram_bytes
    room = total - default_headroom(total) - weights_bytes - outside_pages_bytes
    costs = []
    for mode in MODES:
        try:
            kv = project_kv_bytes(attention_layers, kv_heads, head_dim, max_context, mode)
        except (UnsupportedModeError, ValueError):
            costs.append(ModeCost(mode, None, False))
            continue

        def fits(tokens: int, kv_bytes: int, mode: KvMode = mode) -> bool:
            return kv_bytes + reading_reserve(kv_heads, head_dim, tokens, mode) <= room

        fit = max_context if fits(max_context, kv) else _tokens_that_fit(
            fits, attention_layers, kv_heads, head_dim, max_context, mode)
        costs.append(ModeCost(mode, kv, fits(max_context, kv), fit))
    return tuple(costs)


def reading_reserve(kv_heads: int, head_dim: int, tokens: int, mode: KvMode) -> int:
    """What the memory guard keeps free beside the pages of a ``tokens``-token
    conversation while it is read in (``engine.memory.fit.fit_report``): a chunk's
    attention scratch, or the copy a layer's storage makes as it grows, the larger
    (at the default page size; a chunk's activations, a few per cent of it, are left
    to the headroom)."""
    from engine.cache.pages import DEFAULT_PAGE_SIZE, PREFILL_SCRATCH_BYTES, PageLayout

    growth = PageLayout(mode, DEFAULT_PAGE_SIZE, kv_heads, head_dim).part_bytes(tokens)
    return max(PREFILL_SCRATCH_BYTES, growth)


def _tokens_that_fit(fits: Callable[[int, int], bool], attention_layers: int, kv_heads: int,
                     head_dim: int, max_context: int, mode: KvMode) -> int:
    """Whole ``FIT_STEP``s of context that ``fits`` (tokens, their KV bytes) holds (a
    bisection)."""
    from engine.cache.kvquant import project_kv_bytes

    low, high = 0, max_context // FIT_STEP  # in steps; ``low`` always fits
    while low < high:
        middle = (low + high + 1) // 2
        tokens = middle * FIT_STEP
        kv = project_kv_bytes(attention_layers, kv_heads, head_dim, tokens, mode)
        low, high = (middle, high) if fits(tokens, kv) else (low, middle - 1)
    return low * FIT_STEP
