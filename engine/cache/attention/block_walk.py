"""The pages walked in blocks, each merged into an online softmax.

A prefill chunk dequantizes one block at a time (:func:`attend_blocks`); a decode
step on quantized pages scores each block straight from the packed bytes with
``mx.gather_qmm`` (:func:`attend_packed`). Either way a block waits for the one
before (the host waits under the CPU schedule; the graph orders them under the
GPU schedule, :mod:`engine.cache.attention.schedule`), so only a block's scratch
or two is alive at once and the transient is the same at 32k and at 262k tokens;
on the CPU the KV heads walk on one stream per core
(:mod:`engine.cache.attention.streams`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.cache import kvquant
from engine.cache.attention import schedule, scratch, streams
from engine.cache.attention.blocks import PageBlock
from engine.cache.attention.query_view import QueryView, masked, page_positions


def attend_blocks(view: QueryView, cache: Any, scale: float) -> mx.array:
    store, page_size = cache.store, cache.pool.page_size
    kv_heads, rows, head_dim = view.q.shape
    # Decode keeps its blocks page-major ([pages, kv_heads, page_size, D]): no
    # transposed copy of the rows, one small matmul per page. A prefill chunk's
    # scores dominate its transient; its blocks go heads-first, one matmul per head.
    decode = view.length <= scratch.PACKED_MAX_TOKENS
    # Each group of heads walks the same blocks on its own stream; together they
    # hold what one walk over every head would, so the scratch arithmetic holds.
    # A decode step's many small matmuls stay on one stream: split, two streams'
    # BLAS threads fight over the cores (docs/benchmarks.md, long-context section).
    groups = ([(slice(0, kv_heads), None)] if decode
              else streams.head_groups(kv_heads, cache.offset * kv_heads * head_dim))
    budget = cache.pool.scratch_bytes // scratch.blocks_in_flight()
    if decode:
        budget = min(budget, scratch.decode_scratch_bytes())
    copies = (scratch.DECODE_ROW_COPIES if decode
              else scratch.prefill_row_copies(kv_heads, head_dim, cache.offset,
                                              streams.streams_for(kv_heads)))
    query_rows = scratch.decode_query_rows(view.heads) if decode else kv_heads * rows
    tokens = scratch.block_tokens(query_rows, kv_heads, head_dim, page_size, budget, copies)
    blocks = cache.page_blocks(cache.pool.pages_for(cache.offset), tokens // page_size)
    return _walk(view, scale, blocks, groups,
                 lambda walk, block: _merge_block(walk, store, block, page_size, decode))


def _walk(
    view: QueryView,
    scale: float,
    blocks: list[PageBlock],
    groups: list[tuple[slice, mx.Stream | None]],
    merge: Callable[[_HeadWalk, PageBlock], None],
) -> mx.array:
    """Every group of heads merges every block; the attention output ``[kv_heads, rows, D]``.

    Without an order between blocks the lazy graph may schedule every block's
    scores before the first merge; each block waits for the state before it. The
    CPU schedule makes the host wait (one synchronization per block), the GPU
    schedule makes the block's stored pages wait inside the graph (none).
    """
    in_graph = schedule.current() == schedule.GPU
    if in_graph:
        blocks = _by_slab(blocks)
    walks = [_HeadWalk.start(view.for_heads(heads), scale, heads, stream)
             for heads, stream in groups]
    for index, block in enumerate(blocks):
        for walk in walks:
            with walk.on_stream():
                merge(walk, block)
            if in_graph:
                walk.after = walk.softmax.state()
        if not in_graph and index + 1 < len(blocks):
            schedule.host_sync([walk.softmax.state() for walk in walks])
    outs = [walk.softmax.out / walk.softmax.total for walk in walks]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _by_slab(blocks: list[PageBlock]) -> list[PageBlock]:
    """Each block cut where it crosses into another slab.

    The GPU schedule's blocks are large; joining a block's pieces of two slabs
    would copy the block's packed pages, so each piece merges as a block of its own.
    """
    cut = []
    for block in blocks:
        if len(block.pieces) == 1:
            cut.append(block)
            continue
        start = 0
        for piece in block.pieces:
            local = piece[1]
            count = local.stop - local.start if isinstance(local, slice) else local.size
            logicals = block.logicals[start:start + count]
            cut.append(PageBlock([piece], logicals, max(logicals)))
            start += count
    return cut


@dataclass
class _HeadWalk:
    """One group of KV heads walking the blocks: its queries, stream and softmax."""

    view: QueryView
    q: mx.array  # scaled queries [1, heads, rows, D]
    heads: slice
    stream: mx.Stream | None
    softmax: _OnlineSoftmax
    # What the next block's stored pages wait for (the GPU schedule); None: nothing.
    after: list[mx.array] | None = None

    @classmethod
    def start(cls, view: QueryView, scale: float, heads: slice,
              stream: mx.Stream | None) -> _HeadWalk:
        kv_heads, rows, head_dim = view.q.shape
        return cls(view, (view.q * scale)[None], heads, stream,
                   _OnlineSoftmax.start(kv_heads, rows, head_dim))

    def stored(self, store: Any, block: PageBlock, part: int, heads: slice) -> mx.array | None:
        """:func:`_stored`, ordered after the state of the block before (if told)."""
        return _stored(store, block, part, heads, self.after)

    def on_stream(self) -> Any:
        return contextlib.nullcontext() if self.stream is None else mx.stream(self.stream)


def _merge_block(
    walk: _HeadWalk,
    store: Any,
    block: PageBlock,
    page_size: int,
    page_major: bool,
) -> None:
    # Its own frame: once it returns, no Python name holds the block's arrays, so
    # MLX frees (or reuses) each one as soon as its last consumer ran.
    view = walk.view
    # fp16 pages on a GPU are read as they are stored: the queries and weights
    # meet them in fp16 (as mlx-lm's own fp16 attention does), and only the block's
    # scores, a few rows, are widened. Converting the keys would write and read a
    # copy of every stored value; on the CPU, which emulates fp16, it is cheaper.
    dtype = mx.float16 if _reads_fp16_pages(store, view) else view.dtype
    k_block, v_block = _dequantized_block(walk, store, block, dtype, page_major)
    q = walk.q if dtype == mx.float32 else walk.q.astype(dtype)
    if not page_major:
        scores = (q @ k_block.swapaxes(-1, -2)).astype(mx.float32)  # [1, kv_heads, rows, n]
        if view.sees_whole((block.last + 1) * page_size):
            walk.softmax.add_visible(scores, lambda probs: (probs.astype(dtype) @ v_block)[0])
            return
        hidden = masked(view, scores, page_positions(block.logicals, page_size))
        walk.softmax.add(hidden, lambda weights: mx.sum(weights.astype(dtype) @ v_block, axis=0))
        return
    length = view.length
    scores = _by_position(q, k_block.swapaxes(-1, -2), length).astype(mx.float32)
    hidden = masked(view, scores, page_positions(block.logicals, page_size))  # [pages, ...]
    walk.softmax.add(hidden, lambda weights: mx.sum(
        _by_position(weights.astype(dtype), v_block, length), axis=0))


def _by_position(rows: mx.array, right: mx.array, length: int) -> mx.array:
    """``rows @ right``, each position's rows multiplied on their own.

    ``rows`` are ``[..., kv_heads, repeats * length, n]`` (GQA folded, position
    fastest), ``right`` ``[..., kv_heads, n, m]``. A matmul's rounding depends on
    how many rows it has; multiplied a position at a time, the ``repeats`` rows of
    each position meet the pages in a matmul of a decode step's shape, so a
    speculative verification of ``length`` tokens gives each token the numbers a
    one-token step would.
    """
    if length == 1:
        return rows @ right
    *lead, kv_heads, count, inner = rows.shape
    split = rows.reshape(*lead, kv_heads, count // length, length, inner)
    out = mx.moveaxis(split, -2, -4) @ mx.expand_dims(right, -4)  # [..., length, kv, repeats, m]
    return mx.moveaxis(out, -4, -2).reshape(*out.shape[:-4], kv_heads, count, out.shape[-1])


def _reads_fp16_pages(store: Any, view: QueryView) -> bool:
    """Whether the GPU schedule scores fp16 pages without converting them."""
    return (store.layout.bits == 16 and view.dtype != mx.float32
            and schedule.current() == schedule.GPU)


@dataclass
class _OnlineSoftmax:
    """Running max, sum and weighted values over blocks of scores.

    A block's scores are ``[pages, kv_heads, rows, n]``; ``mix`` turns its weights
    (the same shape) into the weighted sum of the block's values, ``[kv_heads, rows, D]``.
    """

    top: mx.array
    total: mx.array
    out: mx.array

    @classmethod
    def start(cls, kv_heads: int, rows: int, head_dim: int) -> _OnlineSoftmax:
        return cls(
            mx.full((kv_heads, rows, 1), -mx.inf, dtype=mx.float32),
            mx.zeros((kv_heads, rows, 1), dtype=mx.float32),
            mx.zeros((kv_heads, rows, head_dim), dtype=mx.float32),
        )

    def state(self) -> list[mx.array]:
        return [self.top, self.total, self.out]

    def add(self, scores: mx.array, mix: Callable[[mx.array], mx.array]) -> None:
        """Merge one block of masked ``scores`` (-inf where a row may not look)."""
        new_top = mx.maximum(self.top, mx.max(scores, axis=(0, 3), keepdims=True)[0])
        # A row that has seen only masked positions so far keeps -inf; shift by 0 then.
        shift = mx.where(new_top == -mx.inf, 0.0, new_top)
        weights = mx.exp(scores - shift)
        correction = mx.exp(self.top - shift)
        self.total = self.total * correction + mx.sum(weights, axis=(0, 3), keepdims=True)[0]
        self.out = self.out * correction + mix(weights).astype(mx.float32)
        self.top = new_top

    def add_visible(self, scores: mx.array, mix: Callable[[mx.array], mx.array]) -> None:
        """Merge one block ``[1, kv_heads, rows, n]`` that every row sees whole.

        On the CPU a prefill chunk's time is mostly its exponentials: one fused
        softmax pass replaces the separate shift, exp and sum passes, and the
        block's sum comes back as the reciprocal of its largest probability
        (``exp(0) / sum``).
        """
        block_top = mx.max(scores, axis=-1, keepdims=True)[0]
        probs = mx.softmax(scores, axis=-1, precise=True)
        block_total = 1.0 / mx.max(probs, axis=-1, keepdims=True)[0]
        new_top = mx.maximum(self.top, block_top)
        correction = mx.exp(self.top - new_top)
        weight = block_total * mx.exp(block_top - new_top)
        self.total = self.total * correction + weight
        self.out = self.out * correction + mix(probs).astype(mx.float32) * weight
        self.top = new_top


def _stored(
    store: Any, block: PageBlock, part: int, heads: slice, after: list[mx.array] | None = None
) -> mx.array | None:
    """One stored array (codes or scales of keys or values) of a block's pages and heads.

    Pages are taken along the slab's contiguous page axis (taking from a transposed
    view copies the whole slab first); pieces of several slabs are joined while
    still packed, the cheapest copy. None where the mode stores no such array.
    ``after``: arrays every piece waits for in the graph (nothing is read before).
    """
    pieces = []
    for slab_index, local in block.pieces:
        array = store.slabs[slab_index][part]
        if array is None:
            return None
        pieces.append(array[local] if isinstance(local, slice) else mx.take(array, local, axis=0))
    if after is not None:
        pieces = mx.depends(pieces, after)
    joined = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
    return joined if heads == slice(0, store.layout.kv_heads) else joined[:, heads]


def _dequantized_block(
    walk: _HeadWalk, store: Any, block: PageBlock, dtype: mx.Dtype, page_major: bool
) -> tuple[mx.array, mx.array]:
    """Keys and values of a block's pages, for the walk's KV heads.

    ``[pages, heads, page_size, D]`` when ``page_major``, else ``[1, heads,
    tokens, D]``.
    """
    layout = store.layout

    def rows(part: int) -> mx.array:
        codes = walk.stored(store, block, part, walk.heads)
        scales = walk.stored(store, block, part + 1, walk.heads)
        values = kvquant.dequantize_rows(codes, scales, layout.bits, layout.head_dim, dtype)
        if page_major:
            return values
        # Heads first after dequantizing: a copy of this block only.
        return values.swapaxes(0, 1).reshape(1, values.shape[1], -1, layout.head_dim)

    return rows(0), rows(2)


# -- decode straight from the packed bytes -----------------------------------------


def attend_packed(view: QueryView, cache: Any, scale: float, group_size: int) -> mx.array:
    kv_heads, _, head_dim = view.q.shape
    store, page_size = cache.store, cache.pool.page_size
    heads = streams.head_groups(kv_heads, cache.offset * kv_heads * head_dim)
    # Split over streams, a step's peak reaches about twice one block's (each
    # stream frees its block as it finishes): the blocks shrink to match.
    budget = min(cache.pool.scratch_bytes, scratch.decode_scratch_bytes()) // len(heads)
    tokens = scratch.packed_block_tokens(scratch.decode_query_rows(view.heads), kv_heads,
                                         head_dim, store.layout.bits, group_size, page_size,
                                         budget)
    blocks = cache.page_blocks(cache.pool.pages_for(cache.offset), tokens // page_size)
    return _walk(view, scale, blocks, heads,
                 lambda walk, block: _merge_packed_block(walk, store, block, page_size,
                                                         group_size))


def _merge_packed_block(
    walk: _HeadWalk, store: Any, block: PageBlock, page_size: int, group_size: int
) -> None:
    # Scores straight from the packed pages, page-major ([pages, heads, rows,
    # page_size]): the only conversion is the block's scales into MLX's per-group
    # scales and biases. A group of heads picks its rows by index, so taking its
    # heads out of the pages copies nothing.
    view = walk.view
    heads, rows, head_dim = view.q.shape
    kv_heads, bits = store.layout.kv_heads, store.layout.bits
    count = len(block.logicals)
    local = mx.arange(heads, dtype=mx.uint32)
    pages_index = mx.arange(count, dtype=mx.uint32)[:, None]
    target = (pages_index * kv_heads + walk.heads.start + local[None]).reshape(-1)
    every_head = slice(0, kv_heads)

    def affine(part: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
        codes = walk.stored(store, block, part, every_head)
        scales = walk.stored(store, block, part + 1, every_head)
        parts = kvquant.as_mlx_affine(codes, scales, bits, head_dim, group_size, dtype)
        return tuple(x.reshape(count * kv_heads, page_size, -1) for x in parts)

    def mix(weights: mx.array) -> mx.array:
        w, s, b = affine(2, view.dtype)
        weights = weights.reshape(count * heads, rows, page_size).astype(view.dtype)
        mixed = mx.gather_qmm(
            weights, w, s, b, lhs_indices=mx.arange(count * heads, dtype=mx.uint32),
            rhs_indices=target, transpose=False, group_size=group_size, bits=bits,
        )
        return mixed.reshape(count, heads, rows, head_dim).sum(axis=0)

    w, s, b = affine(0, mx.float32)
    scores = mx.gather_qmm(
        walk.q[0], w, s, b, lhs_indices=mx.tile(local, count), rhs_indices=target,
        transpose=True, group_size=group_size, bits=bits,
    ).reshape(count, heads, rows, page_size)
    if not view.sees_whole((block.last + 1) * page_size):
        scores = masked(view, scores, page_positions(block.logicals, page_size))
    walk.softmax.add(scores, mix)
