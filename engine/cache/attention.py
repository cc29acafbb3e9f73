"""Attention over a PagedKVCache, read from the stored pages only.

``update_and_fetch`` has already written the new chunk into the pages, so every
query attends the *stored* keys and values of every position up to its own,
its own chunk included, exactly as a decode step would. A token's logits then do
not depend on how the prompt was cut into chunks.

Two paths, neither of which materializes the context:

- few new tokens on quantized pages (decode): scores straight from the packed
  pages with ``mx.gather_qmm`` (the stored bytes are MLX's affine layout), one
  joint softmax, GQA folded into rows. The score row ``[rows, context]`` is the
  only context-sized array (16 MiB at 262k for 4 KV heads x 4 rows).
- everything else (prefill chunks, fp16 pages, head dims MLX's quantized kernels
  cannot take): the pages are walked in blocks; each block is dequantized on its
  own and merged with an online softmax (running max and sum). The block size
  follows from a scratch budget, so a chunk's transient is the same at 32k and
  at 262k tokens; :func:`chunk_scratch_bytes` is that transient, for the
  estimates. A decode step on this path keeps its blocks page-major and small
  (``DECODE_SCRATCH_BYTES``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.cache import kvquant, pages, streams
from engine.errors import EngineError

# Up to this many new tokens (decode, short drafts) attend the packed pages directly;
# the score matrix [heads, tokens, context] grows with the chunk, so longer chunks
# walk the pages in blocks instead.
PACKED_MAX_TOKENS = 4
# The most one prefill chunk's attention scratch (scores, their exponentials and
# one dequantized block of keys and values) may take, at any context length; each
# pool carries its own (``PagePool.scratch_bytes``), this is the default.
PREFILL_SCRATCH_BYTES = pages.PREFILL_SCRATCH_BYTES
# A decode step walking the pages (fp16, or a head_dim the packed kernels cannot
# take) has a few score rows, so its blocks are mostly the converted keys and values:
# a block well inside the CPU's caches is as fast as a large one and keeps the
# step's transient far below a prefill chunk's.
DECODE_SCRATCH_BYTES = 16 * 2**20
_MLX_GROUP_SIZES = (128, 64, 32)
# What one block holds at its peak, per block token, as mx.get_peak_memory measures
# it on the CPU backend (tests/engine/cache/test_attention_blocks.py): two fp32
# scores per query row (the scores and their exponentials or probabilities: MLX
# reuses the other buffers), one mask byte per query row of a KV head, and fp32
# copies of one key row per KV head: keys and values unpacked, scaled and
# transposed, about five alive at once on one stream; split over streams, each
# group converts its own heads as it goes and about two and a half are (a decode
# block stays page-major: one converted copy of each, and the packed pieces a
# block joins across a slab end).
_SCORE_COPIES = 2
_ROW_COPIES = 5.0
_SPLIT_ROW_COPIES = 2.5
_DECODE_ROW_COPIES = 3.0
# Per query row and head value, whatever the block size: the scaled queries, the
# running output, its rescaled copy, one block's weighted values before and after
# their scaling, and the returned output, in fp32 (measured: 5.6-6.2 copies).
_OUT_COPIES = 6
# A decode step scored from the packed pages holds, per block token, fp32 scores
# per query row (scores, masked, exponentials), and per KV head MLX's per-group
# scales and biases of the keys and values (fp32) and a copy of their packed rows
# (a block joined across slabs, or one group of heads taken out of the pages).
_PACKED_SCORE_COPIES = 3
_PACKED_AFFINE_COPIES = 4


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """fp32 on the CPU backend (fp16 math is emulated there), else the model's dtype."""
    return mx.float32 if mx.default_device().type == mx.cpu else dtype


def group_size_for(head_dim: int) -> int | None:
    """Largest MLX group size that divides ``head_dim`` (None: no packed path)."""
    return next((g for g in _MLX_GROUP_SIZES if head_dim % g == 0), None)


def block_tokens(
    query_rows: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    scratch_bytes: int,
    row_copies: float | None = None,
) -> int:
    """Tokens of one attention block so that the attention's scratch fits ``scratch_bytes``.

    Args:
        query_rows: query heads times new tokens (every row scores every block key
            of its KV head).
        kv_heads: KV heads of the layer.
        head_dim: values per head.
        page_size: blocks are whole pages.
        scratch_bytes: the budget for one call's transient arrays.
        row_copies: fp32 copies of one key row per KV head a block holds at once
            (None: a prefill chunk's, for how this device splits the heads).
    """
    row_copies = row_copies or _prefill_row_copies(kv_heads, head_dim, None)
    room = scratch_bytes - _fixed_bytes(query_rows, head_dim)
    per_token = _bytes_per_token(query_rows, kv_heads, head_dim, row_copies)
    return max(1, room // (per_token * page_size)) * page_size


def packed_block_tokens(
    query_rows: int,
    kv_heads: int,
    head_dim: int,
    bits: int,
    group_size: int,
    page_size: int,
    scratch_bytes: int,
) -> int:
    """Tokens of one block of a decode step scored straight from the packed pages.

    Args:
        query_rows: query heads times new tokens.
        kv_heads: KV heads of the layer.
        head_dim: values per head.
        bits: bits per stored value.
        group_size: MLX group size the pages are read with.
        page_size: blocks are whole pages.
        scratch_bytes: the budget for the step's transient arrays.
    """
    affine = _PACKED_AFFINE_COPIES * 4 * (head_dim // group_size)
    packed = 2 * kvquant.packed_dim(head_dim, bits)
    per_token = 4 * _PACKED_SCORE_COPIES * query_rows + kv_heads * (affine + packed)
    room = scratch_bytes - _fixed_bytes(query_rows, head_dim)
    return max(1, room // (per_token * page_size)) * page_size


def chunk_scratch_bytes(
    chunk: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    scratch_bytes: int,
    context: int | None = None,
) -> int:
    """Bytes the attention of one prefill chunk allocates at its peak, per layer.

    The arithmetic that sizes the attention's blocks (:func:`block_tokens`), so the
    fit check, the memory guard and the stats predict what it will allocate.

    Args:
        chunk: new tokens of the chunk.
        q_heads: query heads of the layer.
        kv_heads: KV heads of the layer.
        head_dim: values per head.
        page_size: tokens per page.
        scratch_bytes: the pool's scratch budget (``PagePool.scratch_bytes``).
        context: tokens the layer holds once the chunk is in (None: long enough
            for full blocks); a shorter context makes a smaller block.
    """
    rows = q_heads * chunk
    copies = _prefill_row_copies(kv_heads, head_dim, context)
    tokens = block_tokens(rows, kv_heads, head_dim, page_size, scratch_bytes, copies)
    if context is not None:
        tokens = min(tokens, -(-context // page_size) * page_size)
    per_token = _bytes_per_token(rows, kv_heads, head_dim, copies)
    return tokens * per_token + _fixed_bytes(rows, head_dim)


def _prefill_row_copies(kv_heads: int, head_dim: int, context: int | None) -> float:
    values = streams.SPLIT_MIN_VALUES if context is None else context * kv_heads * head_dim
    split = streams.group_count(kv_heads, values) > 1
    return _SPLIT_ROW_COPIES if split else _ROW_COPIES


def _bytes_per_token(query_rows: int, kv_heads: int, head_dim: int, row_copies: float) -> int:
    mask = query_rows // kv_heads
    return int(4 * (_SCORE_COPIES * query_rows + row_copies * kv_heads * head_dim)) + mask


def _fixed_bytes(query_rows: int, head_dim: int) -> int:
    return 4 * _OUT_COPIES * query_rows * head_dim


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
    view = _QueryView.of(queries, cache, mask)
    bits = cache.store.layout.bits
    group_size = group_size_for(cache.head_dim)
    if view.length <= PACKED_MAX_TOKENS and bits != 16 and group_size:
        out = _attend_packed(view, cache, scale, group_size)
    else:
        out = _attend_blocks(view, cache, scale)
    return out.reshape(1, view.heads, view.length, cache.head_dim).astype(queries.dtype)


@dataclass(frozen=True)
class _QueryView:
    """The queries folded for GQA (``[kv_heads, repeats * L, D]``) and their mask."""

    q: mx.array
    heads: int
    length: int
    first: int  # cache position of the first query
    mask: Any  # "causal", None, or the mask folded to [1 or kv_heads, rows, columns]
    dtype: mx.Dtype

    @classmethod
    def of(cls, queries: mx.array, cache: Any, mask: Any) -> _QueryView:
        _, heads, length, head_dim = queries.shape
        kv_heads = cache.kv_heads
        repeats = heads // kv_heads
        # Q·Kᵀ in fp32 even on Metal: fp16 queries and scales push q8's error from
        # ~1% towards ~1.4% (measured in issue 3).
        q = queries[0].astype(mx.float32).reshape(kv_heads, repeats * length, head_dim)
        if isinstance(mask, mx.array):
            mask = _fold_mask(mask, kv_heads, repeats, length)
        elif mask is not None and mask != "causal":
            raise EngineError(f"The paged KV cache cannot apply a {mask!r} attention mask.")
        first = cache.offset - length
        return cls(q, heads, length, first, mask, compute_dtype(queries.dtype))

    def for_heads(self, heads: slice) -> _QueryView:
        """The view of the KV heads ``heads`` only (their queries and mask rows)."""
        if heads == slice(0, self.q.shape[0]):
            return self
        mask = self.mask
        if isinstance(mask, mx.array) and mask.shape[0] > 1:
            mask = mask[heads]
        return _QueryView(self.q[heads], self.heads, self.length, self.first, mask, self.dtype)

    def sees_whole(self, end: int) -> bool:
        """Whether every query row may see every stored position before ``end``."""
        return not isinstance(self.mask, mx.array) and end <= self.first

    def allowed(self, positions: mx.array) -> mx.array:
        """Which stored positions each query row may see, as a bool mask.

        Columns past the cache's end (the unwritten rest of a page) are never
        allowed; "causal" lets each query see positions up to its own.
        """
        if self.mask == "causal" and self.length > 1:
            rows = self.q.shape[1]
            query_position = self.first + mx.arange(rows, dtype=mx.int32) % self.length
            return (positions[None] <= query_position[:, None])[None]
        return (positions < self.first + self.length)[None, None]

    def additive_or_bool(self, positions: mx.array, end: int) -> tuple[Any, Any]:
        """The folded mask array's columns at ``positions``: (bool allowed, additive)."""
        column = mx.minimum(positions, end - 1)
        picked = mx.take(self.mask, column, axis=-1)
        inside = (positions < end)[None, None]
        if picked.dtype == mx.bool_:
            return picked & inside, None
        return inside, picked


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


def _masked(view: _QueryView, scores: mx.array, positions: mx.array) -> mx.array:
    """``scores`` with every position the queries may not see set to -inf.

    ``scores`` are ``[kv_heads, rows, n]``, or ``[pages, kv_heads, rows, n]`` with
    ``positions`` (``pages * n``) cut the same way.
    """
    end = view.first + view.length
    pages = scores.shape[0] if scores.ndim == 4 else None
    if isinstance(view.mask, mx.array):
        allowed, additive = view.additive_or_bool(positions, end)
        if additive is not None:
            scores = scores + _by_page(additive, pages).astype(scores.dtype)
    else:
        allowed = view.allowed(positions)
    return mx.where(_by_page(allowed, pages), scores, -mx.inf)


def _by_page(columns: mx.array, pages: int | None) -> mx.array:
    """``[..., rows, pages * n]`` as ``[pages, ..., rows, n]`` (a view; None: as is)."""
    if pages is None:
        return columns
    split = columns.reshape(*columns.shape[:-1], pages, -1)
    return mx.moveaxis(split, -2, 0)


def _page_positions(logicals: list[int], page_size: int) -> mx.array:
    logical = mx.array(logicals, dtype=mx.int32)[:, None] * page_size
    return (logical + mx.arange(page_size, dtype=mx.int32)[None]).reshape(-1)


# -- blocks with an online softmax -------------------------------------------------


def _attend_blocks(view: _QueryView, cache: Any, scale: float) -> mx.array:
    store, page_size = cache.store, cache.pool.page_size
    kv_heads, rows, head_dim = view.q.shape
    # Decode keeps its blocks page-major ([pages, kv_heads, page_size, D]): no
    # transposed copy of the rows, one small matmul per page. A prefill chunk's
    # scores dominate its transient; its blocks go heads-first, one matmul per head.
    decode = view.length <= PACKED_MAX_TOKENS
    budget = cache.pool.scratch_bytes
    if decode:
        budget = min(budget, DECODE_SCRATCH_BYTES)
    values = cache.offset * kv_heads * head_dim
    copies = _DECODE_ROW_COPIES if decode else _prefill_row_copies(kv_heads, head_dim, cache.offset)
    tokens = block_tokens(kv_heads * rows, kv_heads, head_dim, page_size, budget, copies)
    pages_per_block = tokens // page_size
    blocks = list(_blocks(cache.page_groups(cache.pool.pages_for(cache.offset)), pages_per_block))
    # Each group of heads walks the same blocks on its own stream; together they
    # hold what one walk over every head would, so the scratch arithmetic holds.
    groups = [(slice(0, kv_heads), None)] if decode else streams.head_groups(kv_heads, values)
    return _walk(view, scale, blocks, groups,
                 lambda walk, block: _merge_block(walk, store, block, page_size, decode))


def _walk(
    view: _QueryView,
    scale: float,
    blocks: list[Any],
    groups: list[tuple[slice, mx.Stream | None]],
    merge: Callable[[_HeadWalk, Any], None],
) -> mx.array:
    """Every group of heads merges every block; the attention output ``[kv_heads, rows, D]``."""
    walks = [_HeadWalk.start(view.for_heads(heads), scale, heads, stream)
             for heads, stream in groups]
    for block in blocks:
        for walk in walks:
            with walk.on_stream():
                merge(walk, block)
        if len(blocks) > 1:
            # Bound the transient to one block: without this the lazy graph may
            # schedule every block's scores before the first merge.
            mx.eval([walk.softmax.state() for walk in walks])
    outs = [walk.softmax.out / walk.softmax.total for walk in walks]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


@dataclass
class _HeadWalk:
    """One group of KV heads walking the blocks: its queries, stream and softmax."""

    view: _QueryView
    q: mx.array  # scaled queries [1, heads, rows, D]
    heads: slice
    stream: mx.Stream | None
    softmax: _OnlineSoftmax

    @classmethod
    def start(cls, view: _QueryView, scale: float, heads: slice,
              stream: mx.Stream | None) -> _HeadWalk:
        kv_heads, rows, head_dim = view.q.shape
        return cls(view, (view.q * scale)[None], heads, stream,
                   _OnlineSoftmax.start(kv_heads, rows, head_dim))

    def on_stream(self) -> Any:
        return contextlib.nullcontext() if self.stream is None else mx.stream(self.stream)


def _merge_block(
    walk: _HeadWalk,
    store: Any,
    block: list[tuple[int, mx.array | slice, list[int]]],
    page_size: int,
    page_major: bool,
) -> None:
    # Its own frame: once it returns, no Python name holds the block's arrays, so
    # MLX frees (or reuses) each one as soon as its last consumer ran.
    view = walk.view
    logicals = [page for _, _, pages in block for page in pages]
    k_block, v_block = _dequantized_block(store, block, view.dtype, page_major, walk.heads)
    scores = walk.q @ k_block.swapaxes(-1, -2)  # [pages or 1, kv_heads, rows, tokens]
    if not page_major and view.sees_whole((max(logicals) + 1) * page_size):
        walk.softmax.add_visible(scores, lambda probs: (probs.astype(view.dtype) @ v_block)[0])
        return
    masked = _masked(view, scores, _page_positions(logicals, page_size))
    walk.softmax.add(masked, lambda weights: mx.sum(weights.astype(view.dtype) @ v_block, axis=0))


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


def _blocks(groups: list[Any], pages_per_block: int) -> Any:
    """Blocks of at most ``pages_per_block`` pages, as (slab index, local slots,
    logical pages) pieces.

    A block runs on into the next slab, so its size follows the scratch budget
    alone (what the fit check predicts), not where slabs happen to end. Local slots
    come as a ``slice`` where they are consecutive (the usual case: slots are taken
    lowest first), so a piece is a view of its slab, not a copy.
    """
    block: list[tuple[int, mx.array | slice, list[int]]] = []
    size = 0
    for slab_index, local, logicals in groups:
        slots = local.tolist()
        start = 0
        while start < len(logicals):
            end = min(len(logicals), start + pages_per_block - size)
            piece = slots[start:end]
            if piece == list(range(piece[0], piece[0] + len(piece))):
                block.append((slab_index, slice(piece[0], piece[0] + len(piece)),
                              logicals[start:end]))
            else:
                block.append((slab_index, local[start:end], logicals[start:end]))
            size += end - start
            start = end
            if size == pages_per_block:
                yield block
                block, size = [], 0
    if block:
        yield block


def _stored(store: Any, block: list[Any], part: int, heads: slice) -> mx.array | None:
    """One stored array (codes or scales of keys or values) of a block's pages and heads.

    Pages are taken along the slab's contiguous page axis (taking from a transposed
    view copies the whole slab first); pieces of several slabs are joined while
    still packed, the cheapest copy. None where the mode stores no such array.
    """
    pieces = []
    for slab_index, local, _ in block:
        array = store.slabs[slab_index][part]
        if array is None:
            return None
        pieces.append(array[local] if isinstance(local, slice) else mx.take(array, local, axis=0))
    joined = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
    return joined if heads == slice(0, store.layout.kv_heads) else joined[:, heads]


def _dequantized_block(
    store: Any, block: list[Any], dtype: mx.Dtype, page_major: bool, heads: slice
) -> tuple[mx.array, mx.array]:
    """Keys and values of a block's pages, for the KV heads ``heads``.

    ``[pages, heads, page_size, D]`` when ``page_major``, else ``[1, heads,
    tokens, D]``.
    """
    layout = store.layout

    def rows(part: int) -> mx.array:
        codes, scales = _stored(store, block, part, heads), _stored(store, block, part + 1, heads)
        values = kvquant.dequantize_rows(codes, scales, layout.bits, layout.head_dim, dtype)
        if page_major:
            return values
        # Heads first after dequantizing: a copy of this block only.
        return values.swapaxes(0, 1).reshape(1, values.shape[1], -1, layout.head_dim)

    return rows(0), rows(2)


# -- decode straight from the packed bytes -----------------------------------------


def _attend_packed(view: _QueryView, cache: Any, scale: float, group_size: int) -> mx.array:
    kv_heads, rows, head_dim = view.q.shape
    store, page_size = cache.store, cache.pool.page_size
    heads = streams.head_groups(kv_heads, cache.offset * kv_heads * head_dim)
    # Split over streams, a step's peak measured about twice one block's (each
    # stream frees its block as it finishes): the blocks shrink to match.
    budget = min(cache.pool.scratch_bytes, DECODE_SCRATCH_BYTES) // len(heads)
    tokens = packed_block_tokens(kv_heads * rows, kv_heads, head_dim, store.layout.bits,
                                 group_size, page_size, budget)
    groups = cache.page_groups(cache.pool.pages_for(cache.offset))
    blocks = list(_blocks(groups, tokens // page_size))
    return _walk(view, scale, blocks, heads,
                 lambda walk, block: _merge_packed_block(walk, store, block, page_size,
                                                         group_size))


def _merge_packed_block(
    walk: _HeadWalk, store: Any, block: list[Any], page_size: int, group_size: int
) -> None:
    # Scores straight from the packed pages, page-major ([pages, heads, rows,
    # page_size]): the only conversion is the block's scales into MLX's per-group
    # scales and biases. A group of heads picks its rows by index, so taking its
    # heads out of the pages copies nothing.
    view = walk.view
    heads, rows, head_dim = view.q.shape
    kv_heads, bits = store.layout.kv_heads, store.layout.bits
    logicals = [page for _, _, pages in block for page in pages]
    count = len(logicals)
    local = mx.arange(heads, dtype=mx.uint32)
    pages_index = mx.arange(count, dtype=mx.uint32)[:, None]
    target = (pages_index * kv_heads + walk.heads.start + local[None]).reshape(-1)
    every_head = slice(0, kv_heads)

    def affine(part: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
        codes = _stored(store, block, part, every_head)
        scales = _stored(store, block, part + 1, every_head)
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
    if not view.sees_whole((max(logicals) + 1) * page_size):
        scores = _masked(view, scores, _page_positions(logicals, page_size))
    walk.softmax.add(scores, mix)
