"""How much memory a paged attention call takes: the block sizes and the estimates.

The attention walks the stored columns in blocks whose size follows from a
scratch budget (:func:`block_tokens` for the CPU schedule's walk,
:func:`gpu_block_tokens` for the GPU schedule's prefill blocks);
:func:`chunk_scratch_bytes` is the same arithmetic as a prediction, for the fit
check, the memory guard and the panel. The per-token constants are what
``mx.get_peak_memory`` measures on the CPU backend
(tests/engine/cache/attention/test_block_walk.py, test_gpu.py).
"""

from __future__ import annotations

from engine.cache.attention import streams

# Up to this many new tokens (decode, and a speculative verification of the last
# token plus up to 8 drafted ones) read the columns the way a decode step does;
# the score matrix [heads, tokens, context] grows with the chunk, so longer
# chunks walk the columns in prefill blocks instead.
PACKED_MAX_TOKENS = 9
# The most one prefill chunk's attention scratch (scores, their exponentials and
# one dequantized block of keys and values) may take, at any context length; each
# pool carries its own (``PagePool.scratch_bytes``), this is the default.
# A CPU decode step has a few score rows, so its blocks are mostly the converted
# keys and values: a block well inside the CPU's caches is as fast as a large one
# and keeps the step's transient far below a prefill chunk's.
DECODE_SCRATCH_BYTES = 16 * 2**20
# Blocks of the GPU schedule's graph alive at once: the host allocates the next
# block's buffers while the device still works on the one before, so its prefill
# blocks take half the budget.
_GPU_BLOCKS_IN_FLIGHT = 2
# What one CPU block holds at its peak, per block token, as mx.get_peak_memory
# measures it on the CPU backend: two fp32 scores per query row (the scores and
# their exponentials or probabilities: MLX reuses the other buffers), one mask
# byte per query row of a KV head, and fp32 copies of one key row per KV head:
# keys and values unpacked and scaled, about three alive at once on one stream;
# split over streams, each group converts its own heads as it goes and about two
# and a half are (a decode block: its converted keys and values and one more).
_SCORE_COPIES = 2
_ROW_COPIES = 3.0
_SPLIT_ROW_COPIES = 2.5
DECODE_ROW_COPIES = 3.0
# Per query row and head value, whatever the block size: the scaled queries, the
# running output, its rescaled copy, one block's weighted values before and after
# their scaling, and the returned output, in fp32 (as peak memory counts them:
# docs/benchmarks.md, "Figures behind constants").
_OUT_COPIES = 6
# A GPU prefill block holds, per block token and query row, its scores, their
# masked copy and their probabilities in the attention dtype (16-bit), and one
# mask byte; it reads the stored columns in place.
_GPU_SCORE_BYTES = 3 * 2 + 1


def decode_query_rows(heads: int) -> int:
    """Query rows a decode-path call's blocks are sized for, whatever its token count.

    Sized for the most tokens that path takes, every call of up to
    ``PACKED_MAX_TOKENS`` tokens cuts the columns into the same blocks, so a
    speculative verification merges its online softmax block for block as a
    one-token step does (and stays inside the decode budget).
    """
    return heads * PACKED_MAX_TOKENS


def block_tokens(
    query_rows: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    scratch_bytes: int,
    row_copies: float = _ROW_COPIES,
) -> int:
    """Tokens of one CPU attention block so that the attention's scratch fits ``scratch_bytes``.

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


def gpu_block_tokens(query_rows: int, head_dim: int, page_size: int, scratch_bytes: int,
                     converted_bytes: int = 0) -> int:
    """Tokens of one GPU-schedule block (whole pages) within ``scratch_bytes``.

    ``converted_bytes``: what the block converts per token on top of its scores
    (keys and values in the queries' dtype where the stored rows are not read in
    place: a float32 model's fp16 pages, a head_dim MLX's quantized kernels cannot
    read); 0 where the kernels read the pages as stored.
    """
    room = scratch_bytes // _GPU_BLOCKS_IN_FLIGHT - _fixed_bytes(query_rows, head_dim)
    per_token = _GPU_SCORE_BYTES * query_rows + converted_bytes
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
    gpu: bool = False,
) -> int:
    """Bytes the attention of one prefill chunk allocates at its peak, per layer.

    The arithmetic that sizes the attention's blocks (:func:`block_tokens`,
    :func:`gpu_block_tokens`), so the fit check, the memory guard and the stats
    predict what it will allocate.

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
        gpu: the GPU schedule's blocks (``schedule.current()``, asked there too).
    """
    rows = q_heads * chunk
    if gpu:
        tokens = gpu_block_tokens(rows, head_dim, page_size, scratch_bytes)
        tokens = tokens if context is None else min(tokens, -(-context // page_size) * page_size)
        per_block = tokens * _GPU_SCORE_BYTES * rows + _fixed_bytes(rows, head_dim)
        return _GPU_BLOCKS_IN_FLIGHT * per_block
    copies = prefill_row_copies(kv_heads, head_dim, context, head_streams)
    tokens = block_tokens(rows, kv_heads, head_dim, page_size, scratch_bytes, copies)
    if context is not None:
        tokens = min(tokens, -(-context // page_size) * page_size)
    per_token = _bytes_per_token(rows, kv_heads, head_dim, copies)
    return tokens * per_token + _fixed_bytes(rows, head_dim)


def decode_scratch_bytes(
    q_heads: int, kv_heads: int, head_dim: int, page_size: int, scratch_bytes: int
) -> int:
    """Bytes one decode step's attention allocates at its peak, per layer and row.

    The blocks a decode-path call walks (``block_walk.attend_blocks``): sized for
    :func:`decode_query_rows` within the smaller of the pool's budget and
    ``DECODE_SCRATCH_BYTES``, at any context.
    """
    rows = decode_query_rows(q_heads)
    budget = min(scratch_bytes, DECODE_SCRATCH_BYTES)
    tokens = block_tokens(rows, kv_heads, head_dim, page_size, budget, DECODE_ROW_COPIES)
    per_token = _bytes_per_token(rows, kv_heads, head_dim, DECODE_ROW_COPIES)
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
