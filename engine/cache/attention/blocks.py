"""Attention blocks: a layer's pages cut into the pieces one attention step reads."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class PageBlock:
    """Pages the attention reads as one block: (slab index, local slots) pieces.

    ``logicals`` are the block's logical page numbers in piece order, ``last`` the
    highest of them.
    """

    pieces: list[tuple[int, mx.array | slice]]
    logicals: list[int]
    last: int


def blocks_of(groups: list[tuple[int, mx.array, list[int]]],
              pages_per_block: int) -> list[PageBlock]:
    """:meth:`PageStore.group`'s pieces cut into blocks of at most ``pages_per_block``.

    A block runs on into the next slab, so its size follows the scratch budget
    alone (what the fit check predicts), not where slabs happen to end. Local slots
    come as a ``slice`` where they are consecutive (the usual case: slots are taken
    lowest first), so a piece is a view of its slab, not a copy.
    """
    blocks: list[PageBlock] = []
    pieces: list[tuple[int, mx.array | slice]] = []
    logicals: list[int] = []
    for slab_index, local, slab_logicals in groups:
        slots = local.tolist()
        start = 0
        while start < len(slab_logicals):
            end = min(len(slab_logicals), start + pages_per_block - len(logicals))
            piece = slots[start:end]
            if piece == list(range(piece[0], piece[0] + len(piece))):
                pieces.append((slab_index, slice(piece[0], piece[0] + len(piece))))
            else:
                pieces.append((slab_index, local[start:end]))
            logicals += slab_logicals[start:end]
            start = end
            if len(logicals) == pages_per_block:
                blocks.append(PageBlock(pieces, logicals, max(logicals)))
                pieces, logicals = [], []
    if logicals:
        blocks.append(PageBlock(pieces, logicals, max(logicals)))
    return blocks
