"""One forward pass over several conversations' caches, each kept whole and its own.

mlx-lm batches rows by padding every sequence to the longest and holding them in
one ``BatchKVCache``. Here each conversation keeps its own paged cache, in its
own KV mode, and a decode step's batch sees them through a view per layer:

- a paged layer becomes a :class:`PagedRows`: its ``offset`` is every row's own
  position (mlx-lm's RoPE takes an array of offsets, one per row), its
  ``update_and_fetch`` writes each row's new keys and values into that row's
  pages, and the attention (routed by :mod:`engine.cache.adapter`) attends each
  row's queries over that row's pages only. No row is padded to another's length.
- a linear-attention layer (mlx-lm's ``ArraysCache``, fixed size per row) is
  merged with mlx-lm's own ``ArraysCache.merge`` for the pass and each row's
  state extracted back after it (:meth:`BatchedCache.write_back`).

Other layers (sliding windows, mlx-lm's own full caches) are refused: batching
them would need mlx-lm's padded batch caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, _BaseCache

from engine.cache.paged_cache import PagedKVCache
from engine.errors import EngineError


class PagedRows(_BaseCache):
    """One paged layer of every row of a batch, for one forward pass.

    Args:
        rows: each row's :class:`PagedKVCache` of this layer, in batch order.
        offsets: each row's position before the pass (shared by every layer's
            view: all paged layers of a conversation hold the same tokens).
    """

    def __init__(self, rows: Sequence[PagedKVCache], offsets: mx.array) -> None:
        self.rows = tuple(rows)
        self.offset = offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write row ``i``'s keys and values (``[B, kv_heads, L, D]``) into row ``i``'s pages.

        The paged attention reads each row's pages, never what this returns.
        """
        if keys.shape[0] != len(self.rows):
            raise EngineError(
                f"A batch of {len(self.rows)} conversations got {keys.shape[0]} rows of keys."
            )
        for index, row in enumerate(self.rows):
            row.update_and_fetch(keys[index:index + 1], values[index:index + 1])
        self.offset = self.offset + keys.shape[2]
        return keys, values

    def make_mask(self, N: int, window_size: int | None = None,
                  return_array: bool = False) -> Any:
        """No mask: each row's attention knows its own row's positions.

        Reserves every row's pages first, so a budget error leaves every layer
        untouched (as :meth:`PagedKVCache.make_mask` does for one row).
        """
        if N != 1 or window_size is not None or return_array:
            raise EngineError("A batch of conversations decodes one token per row at a time.")
        for row in self.rows:
            row.pool.ensure(row.offset + N)
        return None

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)


class BatchedCache:
    """Every layer of a batch's conversations as one mlx-lm prompt cache.

    Args:
        caches: each row's per-layer cache list (a session's ``cache``), in batch
            order; every list has the same layers.

    Raises:
        EngineError: a layer the batch cannot carry (sliding windows, a cache
            that is not paged), or rows whose layers differ.
    """

    def __init__(self, caches: Sequence[list[Any]]) -> None:
        self.caches = list(caches)
        check_batchable(self.caches)
        paged = [next(c for c in row if isinstance(c, PagedKVCache)) for row in self.caches
                 if any(isinstance(c, PagedKVCache) for c in row)]
        offsets = mx.array([c.offset for c in paged], dtype=mx.int32)
        self.layers: list[Any] = []
        for index in range(len(self.caches[0])):
            layer = [row[index] for row in self.caches]
            if isinstance(layer[0], PagedKVCache):
                self.layers.append(PagedRows(layer, offsets))
            else:
                self.layers.append(ArraysCache.merge(layer))

    def write_back(self) -> None:
        """Give each row its own state of the merged (linear-attention) layers."""
        for index, layer in enumerate(self.layers):
            if isinstance(layer, ArraysCache):
                for row, cache in enumerate(self.caches):
                    # Into the row's own object: its checkpoints and stats hold it.
                    cache[index].cache = layer.extract(row).cache


def check_batchable(caches: Sequence[list[Any]]) -> None:
    """Raise EngineError unless these conversations' caches can share a forward pass.

    Args:
        caches: each conversation's per-layer cache list.
    """
    if not caches:
        raise EngineError("A batch needs at least one conversation.")
    layers = len(caches[0])
    for cache in caches:
        if len(cache) != layers:
            raise EngineError("Conversations of different models cannot share a batch.")
        for layer in cache:
            if not isinstance(layer, PagedKVCache | ArraysCache):
                raise EngineError(
                    f"This model's {type(layer).__name__} layers cannot decode in a batch "
                    "yet (only paged and linear-attention layers can); its conversations "
                    "answer one at a time."
                )
    for index in range(layers):
        kinds = {type(cache[index]) for cache in caches}
        if len(kinds) > 1:
            raise EngineError("Conversations of different models cannot share a batch.")
