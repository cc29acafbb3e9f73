"""How much memory a paged attention call takes: the block sizes and the estimates.

The attention walks the pages in blocks whose size follows from a scratch budget
(:func:`block_tokens`, :func:`packed_block_tokens`); :func:`chunk_scratch_bytes` is
the same arithmetic as a prediction, for the fit check, the memory guard and the
panel. The per-token constants are what ``mx.get_peak_memory`` measures on the CPU
backend (tests/engine/cache/attention/test_block_walk.py).
"""

from __future__ import annotations

from engine.cache import kvquant
from engine.cache.attention import schedule, streams

# Up to this many new tokens (decode, and a speculative verification of the last
# token plus up to 8 drafted ones) read the pages the way a decode step does: packed
# pages directly (GPU schedule), else page-major; the score matrix [heads, tokens, context]
# grows with the chunk, so longer chunks walk the pages in prefill blocks instead.
PACKED_MAX_TOKENS = 9
# The most one prefill chunk's attention scratch (scores, their exponentials and
# one dequantized block of keys and values) may take, at any context length; each
# pool carries its own (``PagePool.scratch_bytes``), this is the default.
# A decode step walking the pages (fp16, any mode on the CPU, or a head_dim the
# packed kernels cannot take) has a few score rows, so its blocks are mostly the
# converted keys and values: a block well inside the CPU's caches is as fast as a
# large one and keeps the step's transient far below a prefill chunk's.
DECODE_SCRATCH_BYTES = 16 * 2**20
# The GPU schedule's decode blocks (:mod:`engine.cache.attention.schedule`): the
# host never waits between them, so a block is sized for few kernel launches per
# layer rather than for a cache; its transient stays far below a prefill chunk's.
GPU_DECODE_SCRATCH_BYTES = 32 * 2**20
# Blocks of the GPU schedule's graph alive at once: the host allocates the next
# block's buffers while the device still works on the one before (a chunk of
# full blocks reaches about twice one block's scratch; docs/benchmarks.md,
# attention schedules), so its prefill blocks take half the budget.
_GPU_BLOCKS_IN_FLIGHT = 2
# What one block holds at its peak, per block token, as mx.get_peak_memory measures
# it on the CPU backend (tests/engine/cache/attention/test_block_walk.py): two fp32
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
DECODE_ROW_COPIES = 3.0
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


def decode_query_rows(heads: int) -> int:
    """Query rows a decode-path call's blocks are sized for, whatever its token count.

    Sized for the most tokens that path takes, every call of up to
    ``PACKED_MAX_TOKENS`` tokens cuts the pages into the same blocks, so a
    speculative verification merges its online softmax block for block as a
    one-token step does (and stays inside the decode budget).
    """
    return heads * PACKED_MAX_TOKENS


def decode_scratch_bytes() -> int:
    """The scratch budget of one decode step's blocks under the current schedule."""
    return GPU_DECODE_SCRATCH_BYTES if schedule.current() == schedule.GPU else DECODE_SCRATCH_BYTES


def blocks_in_flight() -> int:
    """Prefill blocks alive at once under the current schedule (their budget's share)."""
    return _GPU_BLOCKS_IN_FLIGHT if schedule.current() == schedule.GPU else 1


def block_tokens(
    query_rows: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    scratch_bytes: int,
    row_copies: float = _ROW_COPIES,
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
            (default: a prefill chunk's on one stream; see :func:`prefill_row_copies`).
    """
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
    head_streams: int = 1,
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
        head_streams: streams the heads of a long context split over on this
            device (``streams.streams_for``, asked on the engine thread).
    """
    rows = q_heads * chunk
    copies = prefill_row_copies(kv_heads, head_dim, context, head_streams)
    tokens = block_tokens(rows, kv_heads, head_dim, page_size, scratch_bytes, copies)
    if context is not None:
        tokens = min(tokens, -(-context // page_size) * page_size)
    per_token = _bytes_per_token(rows, kv_heads, head_dim, copies)
    return tokens * per_token + _fixed_bytes(rows, head_dim)


def prefill_row_copies(
    kv_heads: int, head_dim: int, context: int | None, head_streams: int
) -> float:
    """Converted fp32 copies of a key row per KV head a prefill block holds at once,
    with the heads split over up to ``head_streams`` streams (plain arithmetic)."""
    values = streams.SPLIT_MIN_VALUES if context is None else context * kv_heads * head_dim
    split = streams.split_count(head_streams, values) > 1
    return _SPLIT_ROW_COPIES if split else _ROW_COPIES


def _bytes_per_token(query_rows: int, kv_heads: int, head_dim: int, row_copies: float) -> int:
    mask = query_rows // kv_heads
    return int(4 * (_SCORE_COPIES * query_rows + row_copies * kv_heads * head_dim)) + mask


def _fixed_bytes(query_rows: int, head_dim: int) -> int:
    return 4 * _OUT_COPIES * query_rows * head_dim
