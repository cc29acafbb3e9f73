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
- any other mlx-lm cache (a sliding window's ``RotatingKVCache``, mlx-lm's own
  ``KVCache`` or ``QuantizedKVCache`` where the probe chose it) becomes a
  :class:`CacheRows`: each row's cache is updated and attended on its own by
  mlx-lm's own attention, with that row's own mask. mlx-lm's padded batch
  caches would hold every row at the longest row's length.

Each row of a pass is thus computed by the ops its own decode step runs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from engine.cache import pages
from engine.cache.mlx_lm_compat import BaseCache
from engine.cache.paged_cache import PagedKVCache, cache_tokens, row_of
from engine.errors import EngineError


class _PassView(BaseCache):
    """A layer of every row of a batch, as one pass's forward sees it.

    mlx-lm's pipeline stage hangs its send on its last layer's ``keys``. A decode
    pass reaches the send through its output (the stage's ``all_gather``), and the
    view goes with the pass, so what is hung on it is dropped.
    """

    @property
    def keys(self) -> mx.array:
        return mx.zeros((0,))

    @keys.setter
    def keys(self, value: mx.array | None) -> None:
        del value


class PagedRows(_PassView):
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
        _, kv_heads, length, head_dim = keys.shape
        for row in self.rows:
            row.reserve(kv_heads, head_dim, length)
        # Rows a layer encodes alike (one mode and rotation: usually all of them)
        # are rotated and quantized in one op each, then written row by row.
        for indices in _alike(row.encoding() for row in self.rows):
            if len(indices) == len(self.rows):  # every row, in order: no gather
                alike_keys, alike_values = keys, values
            else:
                taken = mx.array(indices)
                alike_keys, alike_values = keys[taken], values[taken]
            _, _, encoded = self.rows[indices[0]].encode(alike_keys, alike_values)
            for place, index in enumerate(indices):
                self.rows[index].append(row_of(encoded, place))
        self.offset = self.offset + length
        return keys, values

    def make_mask(self, N: int, window_size: int | None = None,
                  return_array: bool = False) -> Any:
        """No mask: each row's attention knows its own row's positions.

        Reserves every row's pages first, so a budget error leaves every layer
        untouched (as :meth:`PagedKVCache.make_mask` does for one row).
        """
        if N != 1 or window_size is not None or return_array:
            raise EngineError("A batch of conversations decodes one token per row at a time.")
        pages.ensure_together((row.pool, row.offset + N) for row in self.rows)
        return None

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)


def _alike(keys: Iterable[Hashable]) -> list[list[int]]:
    """Indices grouped by equal key, each group in order, groups by first index."""
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return list(groups.values())


class RowMasks(tuple):
    """Each row's own attention mask (None, or an mlx-lm mask array) for a
    :class:`CacheRows` layer; the model hands it to the attention unread."""


class CacheRows(_PassView):
    """One mlx-lm cache layer of every row of a batch, attended row by row.

    Args:
        rows: each row's mlx-lm cache of this layer, in batch order.
        offsets: each row's position before the pass.
    """

    def __init__(self, rows: Sequence[Any], offsets: mx.array) -> None:
        self.rows = tuple(rows)
        self.offset = offsets
        # Each row's keys and values as its cache returned them, for the attention.
        self.fetched: list[tuple[mx.array, mx.array]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Update row ``i``'s cache with row ``i`` of ``keys`` and ``values``."""
        if keys.shape[0] != len(self.rows):
            raise EngineError(
                f"A batch of {len(self.rows)} conversations got {keys.shape[0]} rows of keys."
            )
        self.fetched = [row.update_and_fetch(keys[index:index + 1], values[index:index + 1])
                        for index, row in enumerate(self.rows)]
        self.offset = self.offset + keys.shape[2]
        return keys, values

    def make_mask(self, N: int, window_size: int | None = None,
                  return_array: bool = False) -> Any:
        """Each row's own mask (a :class:`RowMasks`), or None when no row needs one."""
        if N != 1 or return_array:
            raise EngineError("A batch of conversations decodes one token per row at a time.")
        masks = RowMasks(row.make_mask(N, window_size=window_size, return_array=False)
                         for row in self.rows)
        return None if all(mask is None for mask in masks) else masks

    def attend(self, queries: mx.array, attention: Any, scale: float, mask: Any = None,
               sinks: mx.array | None = None) -> mx.array:
        """Row ``i``'s queries over row ``i``'s keys and values, by ``attention``
        (mlx-lm's own function), with row ``i``'s mask."""
        if mask is not None and not isinstance(mask, RowMasks):
            raise EngineError("A batch of conversations attends with each row's own mask.")
        outs = [attention(queries[index:index + 1], keys, values, row, scale=scale,
                          mask=None if mask is None else mask[index], sinks=sinks)
                for index, (row, (keys, values)) in enumerate(zip(self.rows, self.fetched,
                                                                  strict=True))]
        return mx.concatenate(outs, axis=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)


# The mlx-lm caches a batch attends row by row (CacheRows).
_PER_ROW = (RotatingKVCache, KVCache, QuantizedKVCache)


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
        # Every layer of a conversation holds its tokens: one offset a row.
        offsets = mx.array([cache_tokens(row) for row in self.caches], dtype=mx.int32)
        self.layers: list[Any] = []
        for index in range(len(self.caches[0])):
            layer = [row[index] for row in self.caches]
            if isinstance(layer[0], PagedKVCache):
                self.layers.append(PagedRows(layer, offsets))
            elif isinstance(layer[0], ArraysCache):
                self.layers.append(ArraysCache.merge(layer))
            else:
                self.layers.append(CacheRows(layer, offsets))

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
            if not isinstance(layer, (PagedKVCache, ArraysCache, *_PER_ROW)):
                raise EngineError(
                    f"This model's {type(layer).__name__} layers cannot decode in a batch; "
                    "its conversations answer one at a time."
                )
    for index in range(layers):
        kinds = {type(cache[index]) for cache in caches}
        if len(kinds) > 1:
            raise EngineError("Conversations of different models cannot share a batch.")
