"""Attention over a PagedKVCache: packed-page decode and dequantize-once prefill.

The cache hands back the new chunk at full precision; the cached prefix stays in
pages. Two paths:

- few new tokens (decode): scores straight from the packed pages with
  ``mx.gather_qmm`` (the stored bytes are MLX's affine layout), one joint softmax
  over every page plus the new tokens, GQA folded into rows. No gather, concatenate
  or dequantize of the context.
- many new tokens (prefill chunk), fp16 pages, or head dims MLX's quantized kernels
  cannot take: the prefix is dequantized once per layer per chunk and the fused
  ``mx.fast.scaled_dot_product_attention`` runs over prefix + chunk.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.cache import kvquant
from engine.errors import EngineError

# Up to this many new tokens (decode, short drafts) attend the packed pages directly;
# the score matrix [heads, tokens, context] grows with the chunk (16 tokens x 32 heads
# x 262k context would be 512 MiB), so longer chunks dequantize the prefix instead.
PACKED_MAX_TOKENS = 4
_MLX_GROUP_SIZES = (128, 64, 32)


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """fp32 on the CPU backend (fp16 math is emulated there), else the model's dtype."""
    return mx.float32 if mx.default_device().type == mx.cpu else dtype


def group_size_for(head_dim: int) -> int | None:
    """Largest MLX group size that divides ``head_dim`` (None: no packed path)."""
    return next((g for g in _MLX_GROUP_SIZES if head_dim % g == 0), None)


def paged_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of ``queries`` over a PagedKVCache's prefix plus the new chunk.

    Args:
        queries: ``[1, heads, L, D]``.
        keys: the new chunk's keys ``[1, kv_heads, L, D]`` as update_and_fetch returned.
        values: the new chunk's values, same shape.
        cache: the layer's PagedKVCache (already holding the chunk).
        scale: score scale.
        mask: None, "causal", or an mlx-lm mask array over ``prefix + L`` columns.
        sinks: not supported by the paged cache.

    Returns:
        ``[1, heads, L, D]`` in the queries' dtype.
    """
    if sinks is not None:
        raise EngineError(
            "This model uses attention sinks, which the paged KV cache does not support."
        )
    length = queries.shape[2]
    prefix = cache.offset - length
    dtype = compute_dtype(queries.dtype)
    bits = cache.store.layout.bits
    group_size = group_size_for(cache.head_dim)
    if prefix > 0 and length <= PACKED_MAX_TOKENS and bits != 16 and group_size:
        out = _attend_packed(queries, keys, values, cache, scale, mask, prefix, dtype, group_size)
    else:
        keys, values = keys.astype(dtype), values.astype(dtype)
        if prefix > 0:
            k_prefix, v_prefix = cache.dequantized_prefix(prefix, dtype)
            keys = mx.concatenate([k_prefix, keys], axis=2)
            values = mx.concatenate([v_prefix, values], axis=2)
        out = mx.fast.scaled_dot_product_attention(
            queries.astype(dtype), keys, values, scale=scale, mask=mask
        )
    return out.astype(queries.dtype)


def _fold_mask(mask: mx.array, kv_heads: int, repeats: int, length: int) -> mx.array:
    """An mlx-lm mask ``[..., L, T]`` as ``[1 or kv_heads, repeats * L, T]`` rows."""
    while mask.ndim > 3:
        if mask.shape[0] != 1:
            raise EngineError("The paged KV cache holds one sequence; batch size must be 1.")
        mask = mask[0]
    if mask.ndim == 2:
        mask = mask[None]
    columns = mask.shape[-1]
    if mask.shape[0] == 1:
        mask = mx.broadcast_to(mask[:, None], (1, repeats, length, columns))
        return mask.reshape(1, repeats * length, columns)
    return mask.reshape(kv_heads, repeats * length, columns)


def _apply(scores: mx.array, allowed: mx.array | None, additive: mx.array | None) -> mx.array:
    if additive is not None:
        scores = scores + additive.astype(scores.dtype)
    if allowed is not None:
        scores = mx.where(allowed, scores, mx.finfo(scores.dtype).min)
    return scores


def _attend_packed(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    prefix: int,
    dtype: mx.Dtype,
    group_size: int,
) -> mx.array:
    _, heads, length, head_dim = queries.shape
    kv_heads = cache.kv_heads
    repeats = heads // kv_heads
    rows = repeats * length
    store, page_size = cache.store, cache.pool.page_size
    bits = store.layout.bits
    # Q·Kᵀ in fp32 even on Metal: fp16 queries and scales push q8's error from ~1%
    # towards ~1.4% (measured in issue 3).
    q = queries[0].astype(mx.float32).reshape(kv_heads, rows, head_dim) * scale
    heads_index = mx.arange(kv_heads, dtype=mx.uint32)
    groups = cache.page_groups(cache.pool.pages_for(prefix))

    page_scores, positions, targets = [], [], []
    for slab_index, local, logicals in groups:
        k_codes, k_scales, _, _ = store.slabs[slab_index]
        slots = k_codes.shape[0]
        w, s, b = kvquant.as_mlx_affine(k_codes, k_scales, bits, head_dim, group_size, mx.float32)
        w, s, b = (x.reshape(slots * kv_heads, page_size, -1) for x in (w, s, b))
        target = local[:, None] * kv_heads + heads_index[None]
        source = mx.broadcast_to(heads_index[None], target.shape)
        scores = mx.gather_qmm(
            q, w, s, b, lhs_indices=source, rhs_indices=target,
            transpose=True, group_size=group_size, bits=bits,
        )  # [pages, kv_heads, rows, page_size]
        count = len(logicals)
        page_scores.append(scores.transpose(1, 2, 0, 3).reshape(kv_heads, rows, count * page_size))
        logical = mx.array(logicals, dtype=mx.int32)[:, None] * page_size
        positions.append((logical + mx.arange(page_size, dtype=mx.int32)[None]).reshape(-1))
        targets.append(target.reshape(-1))

    position = positions[0] if len(positions) == 1 else mx.concatenate(positions)
    scores_pages = page_scores[0] if len(page_scores) == 1 else mx.concatenate(page_scores, -1)
    own_keys = keys[0].astype(mx.float32)
    scores_own = q @ own_keys.swapaxes(-1, -2)  # [kv_heads, rows, L]

    # Rows of the last page past the prefix hold the new chunk (or nothing yet).
    allowed_pages = (position < prefix)[None, None]
    allowed_own = None
    add_pages = add_own = None
    if isinstance(mask, mx.array):
        folded = _fold_mask(mask, kv_heads, repeats, length)
        column = mx.minimum(position, prefix - 1)
        on_pages, on_own = mx.take(folded, column, axis=-1), folded[..., prefix:]
        if folded.dtype == mx.bool_:
            allowed_pages = allowed_pages & on_pages
            allowed_own = on_own
        else:
            add_pages, add_own = on_pages, on_own
    elif mask == "causal" and length > 1:  # the chunk sees itself causally, the prefix fully
        own_row = mx.arange(rows) % length
        allowed_own = (own_row[:, None] >= mx.arange(length)[None])[None]

    scores_pages = _apply(scores_pages, allowed_pages, add_pages)
    scores_own = _apply(scores_own, allowed_own, add_own)
    columns = scores_pages.shape[-1]
    probs = mx.softmax(mx.concatenate([scores_pages, scores_own], -1), axis=-1, precise=True)
    out = probs[..., columns:].astype(dtype) @ values[0].astype(dtype)

    start = 0
    for (slab_index, _, logicals), target in zip(groups, targets, strict=True):
        _, _, v_codes, v_scales = store.slabs[slab_index]
        slots = v_codes.shape[0]
        w, s, b = kvquant.as_mlx_affine(v_codes, v_scales, bits, head_dim, group_size, dtype)
        w, s, b = (x.reshape(slots * kv_heads, page_size, -1) for x in (w, s, b))
        count = len(logicals)
        part = probs[..., start : start + count * page_size]
        part = part.reshape(kv_heads, rows, count, page_size).transpose(2, 0, 1, 3)
        part = part.reshape(count * kv_heads, rows, page_size).astype(dtype)
        mixed = mx.gather_qmm(
            part, w, s, b, lhs_indices=mx.arange(count * kv_heads, dtype=mx.uint32),
            rhs_indices=target, transpose=False, group_size=group_size, bits=bits,
        )
        out = out + mixed.reshape(count, kv_heads, rows, head_dim).sum(axis=0)
        start += count * page_size
    return out.reshape(1, heads, length, head_dim)
