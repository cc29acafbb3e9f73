"""The GPU schedule's attention: a handful of kernels per layer, none waiting on the host.

A decode step (or a speculative verification of up to ``PACKED_MAX_TOKENS``
tokens) reads every stored column at once, one op per part of the storage:

- quantized pages: the scores straight from the packed bytes with one
  ``mx.quantized_matmul`` over every KV head (the stored codes are MLX's affine
  layout and their scales and biases are kept in MLX's form), one softmax, and
  one ``mx.quantized_matmul`` of the probabilities with the values;
- fp16 pages: MLX's fused ``scaled_dot_product_attention`` over the stored rows.

A prefill chunk's scores (``[heads, chunk, context]``) would not fit, so its
columns are walked in blocks as large as the scratch budget allows, each merged
into a running softmax (the block's max, its softmax, and its sum recovered from
its largest probability). Blocks follow each other inside one lazy graph (each
block's stored columns wait for the state before it), so nothing waits on the host.

Queries, scores and probabilities are float16 for a float16 or bfloat16 model
(as mlx-lm computes; a bfloat16 query is clipped into float16's range), with
fp32 accumulation inside MLX's kernels and a precise softmax. A float32 model's
decode steps walk the blocks too (a whole-context read would convert the
context to float32 first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.cache import fusion, kvquant
from engine.cache.attention import scratch
from engine.cache.attention.query_view import QueryView, column_positions
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.cache.paged_cache import PagedKVCache
    from engine.cache.pages import PageStore

_SIXTEEN_BITS = (mx.float16, mx.bfloat16)
# A bfloat16 query is clipped here before it becomes float16: the largest value
# both hold (65504 is not a bfloat16).
_QUERY_LIMIT = 65280.0


def attention_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """float16 for a 16-bit model, else the model's own dtype."""
    return mx.float16 if dtype in _SIXTEEN_BITS else dtype


@fusion.compiled
def _to_fp16(x: mx.array) -> mx.array:
    return mx.clip(x, -_QUERY_LIMIT, _QUERY_LIMIT).astype(mx.float16)


def prepared_queries(queries: mx.array) -> mx.array:
    """``queries`` in :func:`attention_dtype` (bfloat16 clipped into float16's range)."""
    if queries.dtype == mx.bfloat16:
        return _to_fp16(queries)
    return queries


def attend(queries: mx.array, view: QueryView, cache: PagedKVCache, scale: float) -> mx.array:
    """Attention over a PagedKVCache under the GPU schedule, ``[kv_heads, rows, D]``.

    ``queries`` are the call's ``[1, heads, L, D]`` in :func:`attention_dtype`;
    ``view`` folds them (same dtype).
    """
    store = cache.held_store
    quantized = store.layout.bits != 16
    group = kvquant.mlx_group_size(cache.head_dim)
    # Whole-context reads in float16 only: float32 queries would have MLX convert
    # every stored row (fp16 pages) or scale (quantized) to float32 for the step;
    # the blocks below bound what that holds.
    sixteen = view.q.dtype == mx.float16
    if view.length <= scratch.PACKED_MAX_TOKENS and sixteen:
        if quantized and group:
            return _decode_quantized(view, cache, scale, group)
        if not quantized:
            return _decode_fp16(queries, view, cache, scale)
    return _prefill(view, cache, scale, group)


def _decode_quantized(view: QueryView, cache: PagedKVCache, scale: float, group: int) -> mx.array:
    end, positions = cache.columns()
    keys, values = _affine(cache.held_store, 0, end), _affine(cache.held_store, 2, end)
    bits = cache.held_store.layout.bits
    scores = _quantized_matmul(_scaled(view.q, scale), keys, True, group, bits)
    if positions is not None or view.length > 1 or isinstance(view.mask, mx.array):
        scores = view.hide(scores, column_positions(0, end, positions))
    probs = mx.softmax(scores, axis=-1, precise=True)
    return _quantized_matmul(probs, values, False, group, bits)


def _quantized_matmul(x: mx.array, stored: Sequence[mx.array], transpose: bool, group: int,
                      bits: int) -> mx.array:
    """``x`` times stored columns given as (codes, scales, biases), MLX's affine layout."""
    words, scales, biases = stored
    return mx.quantized_matmul(x, words, scales, biases, transpose=transpose,
                               group_size=group, bits=bits)


def _scaled(q: mx.array, scale: float) -> mx.array:
    """``q * scale``, no kernel when the rotation already scaled the queries."""
    return q if scale == 1.0 else q * scale


def _affine(store: PageStore, part: int, end: int,
            start: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    """Codes (as MLX's uint32 words), scales and biases of columns ``[start, end)``."""
    words = store.part(part).view(mx.uint32)[:, start:end]
    pairs = store.part(part + 1)
    return words, pairs[0, :, start:end], pairs[1, :, start:end]


def _decode_fp16(queries: mx.array, view: QueryView, cache: PagedKVCache, scale: float) -> mx.array:
    end, positions = cache.columns()
    keys = cache.held_store.part(0)[None, :, :end]
    values = cache.held_store.part(2)[None, :, :end]
    mask: Any = None
    if positions is not None or isinstance(view.mask, mx.array):
        # The same mask for every query head: one row per query position.
        rows = view.for_heads(slice(0, 1))
        shown = rows.hide(mx.zeros((1, rows.q.shape[1], end), queries.dtype),
                          column_positions(0, end, positions))
        mask = shown[:, -view.length:][None]
    elif view.length > 1:
        mask = "causal"
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return out.reshape(view.q.shape)


# -- a prefill chunk, in blocks of columns ------------------------------------------


def _prefill(view: QueryView, cache: PagedKVCache, scale: float, group: int | None) -> mx.array:
    store = cache.held_store
    kv_heads, rows, head_dim = view.q.shape
    q = _scaled(view.q, scale)
    in_place = (store.layout.bits != 16 and group) or view.q.dtype == mx.float16
    converted = 0 if in_place else 2 * kv_heads * head_dim * view.q.dtype.size
    tokens = scratch.gpu_block_tokens(rows * kv_heads, head_dim, cache.pool.page_size,
                                      cache.pool.scratch_bytes, converted)
    end, positions = cache.columns()
    score, mix = _readers(store, group)
    state: tuple[mx.array, ...] | None = None
    for start in range(0, end, tokens):
        stop = min(end, start + tokens)
        scores = score(q, start, stop, None if state is None else list(state))
        if not view.sees_whole(start, stop, positions):
            scores = view.hide(scores, column_positions(start, stop, positions), _HIDDEN)
        top = mx.max(scores, axis=-1, keepdims=True)
        probs = mx.softmax(scores, axis=-1, precise=True)
        # The block's sum of exp(score - top), from its largest probability: exact
        # to float16's relative rounding, where a float16 log-sum-exp would be off
        # by its rounding times its size.
        peak = mx.max(probs, axis=-1, keepdims=True)
        mixed = mix(probs, start, stop)
        state = _merged(*state, mixed, top, peak) if state is not None \
            else _first(mixed, top, peak)
    if state is None:  # no column: every attention call follows its layer's write
        raise EngineError("The attention read a layer that holds no tokens.")
    return state[0]


# A score no query may see, for a block's softmax: finite, so a row the block
# hides entirely gets weights (merged with a zero weight) instead of NaN.
_HIDDEN = -60000.0


@fusion.compiled
def _first(mixed: mx.array, top: mx.array, peak: mx.array) -> tuple[mx.array, ...]:
    return mixed.astype(mx.float32), top.astype(mx.float32), 1.0 / peak.astype(mx.float32)


@fusion.compiled
def _merged(out: mx.array, top: mx.array, total: mx.array, mixed: mx.array,
            block_top: mx.array, peak: mx.array) -> tuple[mx.array, ...]:
    """The running (output, max score, sum of exp(score - max)) with one more block."""
    block_top = block_top.astype(mx.float32)
    new_top = mx.maximum(top, block_top)
    kept = total * mx.exp(top - new_top)
    added = mx.exp(block_top - new_top) / peak.astype(mx.float32)
    new_total = kept + added
    merged = (out * kept + mixed.astype(mx.float32) * added) / new_total
    return merged, new_top, new_total


Reader = Callable[..., mx.array]


def _readers(store: PageStore, group: int | None) -> tuple[Reader, Reader]:
    """(score, mix) of a block of columns, straight from the stored arrays.

    A block's stored columns wait for what comes before them in the graph (its
    keys for the state before the block, its values for the block's own
    probabilities): blocks run in order, and nothing of a block (a conversion
    least of all) is computed before its turn.
    """
    bits = store.layout.bits

    def ordered(arrays: tuple[mx.array, ...], after: list[mx.array] | None) -> list[mx.array]:
        return list(arrays) if after is None else mx.depends(list(arrays), after)

    if bits != 16 and group:
        def score(q: mx.array, start: int, stop: int,
                  after: list[mx.array] | None) -> mx.array:
            keys = ordered(_affine(store, 0, stop, start), after)
            return _quantized_matmul(q, keys, True, group, bits)

        def mix(probs: mx.array, start: int, stop: int) -> mx.array:
            values = ordered(_affine(store, 2, stop, start), [probs])
            return _quantized_matmul(probs, values, False, group, bits)

        return score, mix

    def rows(part: int, start: int, stop: int, dtype: mx.Dtype,
             after: list[mx.array] | None) -> mx.array:
        codes = ordered((store.part(part)[:, start:stop],), after)[0]
        if bits == 16:
            return codes if codes.dtype == dtype else codes.astype(dtype)
        scales = store.part(part + 1)[0, :, start:stop, :1]
        return kvquant.dequantize_rows(codes, scales, bits, store.layout.head_dim, dtype)

    def score_rows(q: mx.array, start: int, stop: int,
                   after: list[mx.array] | None) -> mx.array:
        return q @ rows(0, start, stop, q.dtype, after).swapaxes(-1, -2)

    def mix_rows(probs: mx.array, start: int, stop: int) -> mx.array:
        return probs @ rows(2, start, stop, probs.dtype, [probs])

    return score_rows, mix_rows
