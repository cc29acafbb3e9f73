"""Attention over a PagedKVCache, read from the stored pages only.

``update_and_fetch`` has already written the new chunk into the pages, so every
query attends the *stored* keys and values of every position up to its own,
its own chunk included, exactly as a decode step would. A token's logits then do
not depend on how the prompt was cut into chunks.

Two schedules (:mod:`engine.cache.attention.schedule`), neither of which
materializes a dequantized context:

- ``gpu`` (Metal, CUDA): :mod:`engine.cache.attention.gpu` reads a decode step's
  whole context with one op per part of the storage (the packed pages through
  ``mx.quantized_matmul``, fp16 pages through the fused SDPA) and a prefill
  chunk's in large blocks, all in one lazy graph in the model's 16-bit dtype.
- ``cpu``: :mod:`engine.cache.attention.block_walk` dequantizes one block of
  columns at a time in fp32 (a decode step's 6-bit pages are read packed instead)
  and merges it into an online softmax, the host waiting on each block, the heads
  of a prefill chunk (and of a long decode step) split over the cores, a batch's
  rows each on a core's stream.

Each schedule gives a speculative verification of up to ``PACKED_MAX_TOKENS``
tokens, row for row, the numbers its one-token decode steps would give (on the
CPU backend; MLX's GPU kernels may round a verification's rows apart, within the
dtype's rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.cache.attention import block_walk, gpu, schedule
from engine.cache.attention.query_view import QueryView, compute_dtype
from engine.cache.attention.scratch import PACKED_MAX_TOKENS
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.cache.paged_cache import PagedKVCache

__all__ = ["PACKED_MAX_TOKENS", "compute_dtype", "paged_attention"]


def paged_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: PagedKVCache,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of ``queries`` over everything a PagedKVCache stores.

    Args:
        queries: ``[1, heads, L, D]``, the last ``L`` positions of the cache.
        keys: the new chunk's keys as update_and_fetch returned them (unused: the
            stored, quantized rows are what every position attends).
        values: the new chunk's values (unused, likewise).
        cache: the layer's PagedKVCache (already holding the chunk).
        scale: score scale.
        mask: None, "causal", or an mlx-lm mask array over the cache's positions.
        sinks: not supported by the paged cache.

    Returns:
        ``[1, heads, L, D]`` in the queries' dtype.
    """
    del keys, values
    if sinks is not None:
        raise EngineError(
            "This model uses attention sinks, which the paged KV cache does not support."
        )
    if schedule.current() == schedule.GPU:
        prepared = gpu.prepared_queries(queries)
        view = QueryView.of(prepared, cache, mask, dtype=prepared.dtype)
        out = gpu.attend(prepared, view, cache, scale)
    else:
        view = QueryView.of(queries, cache, mask)
        out = block_walk.attend_blocks(view, cache, scale)
    return out.reshape(1, view.heads, view.length, cache.head_dim).astype(queries.dtype)
