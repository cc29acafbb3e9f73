"""Attention over a PagedKVCache, read from the stored pages only.

``update_and_fetch`` has already written the new chunk into the pages, so every
query attends the *stored* keys and values of every position up to its own,
its own chunk included, exactly as a decode step would. A token's logits then do
not depend on how the prompt was cut into chunks.

Two paths, neither of which materializes the context; both walk the pages in
blocks merged with an online softmax (running max and sum,
:mod:`engine.cache.attention.block_walk`), sized from a scratch budget so a call's
transient is the same at 32k and at 262k tokens (:mod:`engine.cache.attention.scratch`):

- few new tokens on quantized pages (decode) under the GPU schedule: scores
  straight from the packed pages with ``mx.gather_qmm`` (the stored bytes are
  MLX's affine layout), GQA folded into rows, in blocks of ``DECODE_SCRATCH_BYTES``.
- everything else (prefill chunks, fp16 pages, any decode on the CPU, head dims
  MLX's quantized kernels cannot take): each block is dequantized on its own; a
  prefill chunk's blocks fill the pool's scratch budget, a decode step's stay
  page-major and small.

Either decode path gives a speculative verification of up to ``PACKED_MAX_TOKENS``
tokens, row for row, the numbers one-token decode steps would give.

Blocks follow each other by the backend's schedule
(:mod:`engine.cache.attention.schedule`): the host waits on each on the CPU; on a
GPU the whole call is one lazy graph.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.cache.attention import block_walk, schedule
from engine.cache.attention.query_view import QueryView, compute_dtype
from engine.cache.attention.scratch import PACKED_MAX_TOKENS
from engine.errors import EngineError

__all__ = ["PACKED_MAX_TOKENS", "compute_dtype", "group_size_for", "paged_attention",
           "reads_packed_pages"]

_MLX_GROUP_SIZES = (128, 64, 32)


def group_size_for(head_dim: int) -> int | None:
    """Largest MLX group size that divides ``head_dim`` (None: no packed path)."""
    return next((g for g in _MLX_GROUP_SIZES if head_dim % g == 0), None)


def reads_packed_pages() -> bool:
    """Whether a decode step scores quantized pages straight from the packed bytes.

    Under the GPU schedule the packed kernels read a fraction of fp16's bytes. On
    the CPU, MLX's quantized matmul unpacks the pages again for every query row:
    converting each block once and multiplying is faster for one token and several
    times faster for a verification's nine (docs/benchmarks.md, speculative).
    """
    return schedule.current() == schedule.GPU


def paged_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
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
    view = QueryView.of(queries, cache, mask)
    bits = cache.store.layout.bits
    group_size = group_size_for(cache.head_dim)
    if view.length <= PACKED_MAX_TOKENS and bits != 16 and group_size and reads_packed_pages():
        out = block_walk.attend_packed(view, cache, scale, group_size)
    else:
        out = block_walk.attend_blocks(view, cache, scale)
    return out.reshape(1, view.heads, view.length, cache.head_dim).astype(queries.dtype)
