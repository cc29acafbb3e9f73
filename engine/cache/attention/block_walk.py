"""The CPU schedule's attention: the stored columns walked in blocks, each merged
into an online softmax.

Each block of columns is dequantized on its own (fp32), scored and merged, and the
host waits for the running state before the next block
(:func:`engine.cache.attention.schedule.host_sync`), so only a block's scratch is
alive at once and the transient is the same at 32k and at 262k tokens. A decode
step's blocks are small enough to stay in the CPU's caches; a prefill chunk's fill
the pool's scratch budget, with the KV heads split over one stream per core
(:mod:`engine.cache.attention.streams`; a decode step's too at long contexts,
unless it is one row of a batch, whose rows have the streams). A decode step reads
6-bit pages packed, with fp32 queries, through MLX's quantized matmul
(:func:`reads_packed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.cache import kvquant
from engine.cache.attention import schedule, scratch, streams
from engine.cache.attention.query_view import QueryView, column_positions
from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.cache.paged_cache import PagedKVCache
    from engine.cache.pages import PageStore


@dataclass(frozen=True)
class ColumnBlock:
    """Stored columns ``[start, stop)`` read as one block, and their positions."""

    start: int
    stop: int
    positions: mx.array | None  # None: column c holds position c


def column_blocks(end: int, positions: mx.array | None, tokens: int) -> list[ColumnBlock]:
    """Columns ``[0, end)`` cut into blocks of ``tokens``."""
    return [ColumnBlock(start, min(end, start + tokens), positions)
            for start in range(0, end, tokens)]


def attend_blocks(view: QueryView, cache: PagedKVCache, scale: float) -> mx.array:
    kv_heads, rows, head_dim = view.q.shape
    decode = view.length <= scratch.PACKED_MAX_TOKENS
    # Each group of heads walks the same blocks on its own stream; together they
    # hold what one walk over every head would, so the scratch arithmetic holds.
    values = cache.offset * kv_heads * head_dim
    groups = (streams.decode_groups(kv_heads, values) if decode
              else streams.head_groups(kv_heads, values))
    budget = cache.pool.scratch_bytes
    if decode:
        budget = min(budget, scratch.DECODE_SCRATCH_BYTES)
    copies = (scratch.DECODE_ROW_COPIES if decode
              else scratch.prefill_row_copies(kv_heads, head_dim, cache.offset,
                                              streams.streams_for(kv_heads)))
    query_rows = scratch.decode_query_rows(view.heads) if decode else kv_heads * rows
    page_size = cache.pool.page_size
    tokens = scratch.block_tokens(query_rows, kv_heads, head_dim, page_size, budget, copies)
    end, positions = cache.columns()
    if positions is None:
        # Whole pages, the unwritten rest of the last one hidden: a decode step and
        # a verification then cut the same blocks of the same widths, and BLAS
        # rounds a matmul by its shape.
        end = cache.pool.pages_for(end) * page_size
    blocks = column_blocks(end, positions, tokens)
    store = cache.held_store
    if decode and reads_packed(store.layout.bits, head_dim):
        return _walk(view, scale, blocks, groups,
                     lambda walk, block: _merge_packed(walk, store, block))
    return _walk(view, scale, blocks, groups,
                 lambda walk, block: _merge_block(walk, store, block, decode))


def reads_packed(bits: int, head_dim: int) -> bool:
    """Whether a decode step reads ``bits``-bit pages packed, through MLX's
    quantized matmul, rather than unpacked to fp32 for BLAS.

    MLX's CPU quantized matmul reads any width at about one speed; unpacking
    8-bit codes is one conversion and 4-bit ones two, and BLAS then beats it, but
    6-bit codes straddle bytes and their unpacking costs more than the packed read.
    """
    return bits in PACKED_READ_BITS and kvquant.mlx_group_size(head_dim) is not None


# Code widths a decode step reads packed (see reads_packed).
PACKED_READ_BITS = frozenset({6})


def _walk(
    view: QueryView,
    scale: float,
    blocks: list[ColumnBlock],
    groups: list[tuple[slice, mx.Stream | None]],
    merge: Callable[[_HeadWalk, ColumnBlock], None],
) -> mx.array:
    """Every group of heads merges every block; the attention output ``[kv_heads, rows, D]``.

    The host waits for each block's merged state before building the next
    (one synchronization per block), so a block's scratch is freed before the next
    block's is allocated.
    """
    walks = [_HeadWalk.start(view.for_heads(heads), scale, heads, stream)
             for heads, stream in groups]
    for index, block in enumerate(blocks):
        for walk in walks:
            with walk.on_stream():
                merge(walk, block)
        if index + 1 < len(blocks):
            schedule.host_sync([walk.softmax.state() for walk in walks])
    outs = [walk.softmax.out / walk.softmax.total for walk in walks]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


@dataclass
class _HeadWalk:
    """One group of KV heads walking the blocks: its queries, stream and softmax."""

    view: QueryView
    q: mx.array  # scaled queries [heads, rows, D]
    heads: slice
    stream: mx.Stream | None
    softmax: _OnlineSoftmax

    @classmethod
    def start(cls, view: QueryView, scale: float, heads: slice,
              stream: mx.Stream | None) -> _HeadWalk:
        kv_heads, rows, head_dim = view.q.shape
        return cls(view, view.q * scale, heads, stream,
                   _OnlineSoftmax.start(kv_heads, rows, head_dim))

    def on_stream(self) -> Any:
        return contextlib.nullcontext() if self.stream is None else mx.stream(self.stream)


def _merge_block(walk: _HeadWalk, store: PageStore, block: ColumnBlock, decode: bool) -> None:
    # Its own frame: once it returns, no Python name holds the block's arrays, so
    # MLX frees (or reuses) each one as soon as its last consumer ran.
    view = walk.view
    k_block, v_block = _dequantized(store, block, walk.heads)  # [heads, n, D], fp32
    length = view.length if decode else 1
    scores = _by_position(walk.q, k_block.swapaxes(-1, -2), length)  # [heads, rows, n]
    # A decode step merges every block the same way (its last columns hidden or
    # not), so a verification's rows merge as its steps' did.
    if not decode and view.sees_whole(block.start, block.stop, block.positions):
        walk.softmax.add_visible(scores, lambda probs: _by_position(probs, v_block, length))
        return
    positions = column_positions(block.start, block.stop, block.positions)
    hidden = view.hide(scores, positions)
    walk.softmax.add(hidden, lambda weights: _by_position(weights, v_block, length))


def _merge_packed(walk: _HeadWalk, store: PageStore, block: ColumnBlock) -> None:
    """A decode block read from the packed pages: scores and weighted values by
    MLX's quantized matmul on the stored codes, scales and biases (fp32 queries)."""
    view = walk.view
    keys, values = _packed(store, block, walk.heads, 0), _packed(store, block, walk.heads, 2)
    scores = _by_position(walk.q, keys.times, view.length)
    hidden = view.hide(scores, column_positions(block.start, block.stop, block.positions))
    walk.softmax.add(hidden, lambda weights: _by_position(weights, values.times, view.length))


@dataclass(frozen=True)
class _PackedRows:
    """One part of a block's columns as stored (MLX's affine layout)."""

    words: mx.array  # the codes as uint32 words [heads, n, words]
    scales: mx.array
    biases: mx.array
    bits: int
    group: int
    keys: bool  # keys are multiplied transposed (scores), values as they are

    def times(self, x: mx.array) -> mx.array:
        """``x`` times these rows (keys: ``x @ K^T``; values: ``x @ V``)."""
        return mx.quantized_matmul(x, self.words, self.scales, self.biases,
                                   transpose=self.keys, group_size=self.group, bits=self.bits)


def _packed(store: PageStore, block: ColumnBlock, heads: slice, part: int) -> _PackedRows:
    layout = store.layout
    group = kvquant.mlx_group_size(layout.head_dim)
    if group is None:  # reads_packed chose this path for a readable width only
        raise EngineError(f"MLX cannot read {layout.head_dim}-value rows packed.")
    columns = slice(block.start, block.stop)
    pairs = store.part(part + 1)
    return _PackedRows(store.part(part).view(mx.uint32)[heads, columns],
                       pairs[0, heads, columns], pairs[1, heads, columns],
                       layout.bits, group, keys=part == 0)


def _by_position(rows: mx.array, times: Callable[[mx.array], mx.array] | mx.array,
                 length: int) -> mx.array:
    """``rows`` times the block's keys or values, each position's rows on their own.

    ``rows`` are ``[kv_heads, repeats * length, n]`` (GQA folded, position fastest);
    ``times`` multiplies ``[..., kv_heads, r, n]`` rows by the block (an array
    ``[kv_heads, n, m]``: a plain matmul). A matmul's rounding depends on how many
    rows it has; multiplied a position at a time, the ``repeats`` rows of each
    position meet the pages in a matmul of a decode step's shape, so a
    speculative verification of ``length`` tokens gives each token the numbers a
    one-token step would.
    """
    product = times if callable(times) else (lambda x: x @ times)
    if length == 1:
        return product(rows)
    kv_heads, count, inner = rows.shape
    split = rows.reshape(kv_heads, count // length, length, inner)
    out = product(mx.moveaxis(split, -2, 0))  # [length, kv_heads, repeats, m]
    return mx.moveaxis(out, 0, -2).reshape(kv_heads, count, out.shape[-1])


def _dequantized(store: PageStore, block: ColumnBlock, heads: slice) -> tuple[mx.array, mx.array]:
    """Keys and values of a block's columns for ``heads``, ``[heads, n, D]`` in fp32."""
    layout = store.layout

    def rows(part: int) -> mx.array:
        codes = store.part(part)[heads, block.start:block.stop]
        pairs = store.parts[part + 1]
        scales = None if pairs is None else pairs[0, heads, block.start:block.stop, :1]
        return kvquant.dequantize_rows(codes, scales, layout.bits, layout.head_dim)

    return rows(0), rows(2)


@dataclass
class _OnlineSoftmax:
    """Running max, sum and weighted values over blocks of scores.

    A block's scores are ``[kv_heads, rows, n]``; ``mix`` turns its weights (the
    same shape) into the weighted sum of the block's values, ``[kv_heads, rows, D]``.
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
        new_top = mx.maximum(self.top, mx.max(scores, axis=-1, keepdims=True))
        # A row that has seen only masked positions so far keeps -inf; shift by 0 then.
        shift = mx.where(new_top == -mx.inf, 0.0, new_top)
        weights = mx.exp(scores - shift)
        correction = mx.exp(self.top - shift)
        self.total = self.total * correction + mx.sum(weights, axis=-1, keepdims=True)
        self.out = self.out * correction + mix(weights)
        self.top = new_top

    def add_visible(self, scores: mx.array, mix: Callable[[mx.array], mx.array]) -> None:
        """Merge one block that every row sees whole.

        On the CPU a prefill chunk's time is mostly its exponentials: one fused
        softmax pass replaces the separate shift, exp and sum passes, and the
        block's sum comes back as the reciprocal of its largest probability
        (``exp(0) / sum``).
        """
        block_top = mx.max(scores, axis=-1, keepdims=True)
        probs = mx.softmax(scores, axis=-1, precise=True)
        block_total = 1.0 / mx.max(probs, axis=-1, keepdims=True)
        new_top = mx.maximum(self.top, block_top)
        correction = mx.exp(self.top - new_top)
        weight = block_total * mx.exp(block_top - new_top)
        self.total = self.total * correction + weight
        self.out = self.out * correction + mix(probs) * weight
        self.top = new_top
