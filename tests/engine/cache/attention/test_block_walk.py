"""The CPU schedule's walk over the stored columns in blocks: decode blocks, and what a
block holds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache.attention import block_walk, schedule, scratch, streams
from engine.cache.attention import dispatch as attention
from tests.engine.cache.attention.test_dispatch import SAME_ROWS_TOLERANCE, _cache, _normal, _step

MIB = 2**20


def _attention_peak(cache, queries: mx.array, mask, repeats: int = 5) -> int:
    """MLX peak above the memory active before attending ``queries`` (the cache
    excluded), the worst of ``repeats`` calls after one warm-up call.

    One call's peak moves with timing (a buffer is freed once the stream that used
    it has finished with it, which may come after the next block allocates); a
    bound must hold for every call.
    """
    mx.eval(cache.store.arrays())
    peaks = []
    for _ in range(repeats + 1):
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = attention.paged_attention(queries, queries, queries, cache,
                                        cache.head_dim**-0.5, mask)
        mx.eval(out)
        del out
        peaks.append(mx.get_peak_memory() - before)
    return max(peaks[1:])


def _decode_peak(cache, heads: int) -> int:
    """MLX peak above the memory active before one decode step (the cache excluded)."""
    head_dim = cache.head_dim
    keys = _normal((1, cache.kv_heads, 1, head_dim), 1)
    cache.pool.ensure(cache.offset + 1)
    cache.update_and_fetch(keys, keys)
    return _attention_peak(cache, _normal((1, heads, 1, head_dim), 2), None)


@pytest.fixture(autouse=True)
def cpu_schedule():
    with schedule.forced(schedule.CPU):
        yield


@pytest.mark.parametrize("mode", ["fp16", "q8", "q6"])
def test_decode_over_many_blocks_matches_reference(mode: str, monkeypatch) -> None:
    # One page per block: the online softmax merges every page.
    monkeypatch.setattr(scratch, "DECODE_SCRATCH_BYTES", 1)
    cache = _cache(mode, 64, prefix=70)
    for step in range(2):
        got, expected = _step(cache, mode, 1, heads=4, mask=None, seed=30 + 3 * step)
        np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


def test_only_six_bit_pages_mlx_can_read_are_read_packed() -> None:
    assert block_walk.reads_packed(6, 64) and block_walk.reads_packed(6, 256)
    assert not block_walk.reads_packed(8, 64) and not block_walk.reads_packed(4, 64)
    assert not block_walk.reads_packed(16, 64)
    assert not block_walk.reads_packed(6, 40)  # no MLX group divides 40 values


@pytest.mark.parametrize("length", [1, 5])
def test_packed_read_gives_the_unpacked_reads_numbers(length: int, monkeypatch) -> None:
    # A decode step and a verification over several blocks (one page each), read
    # packed by MLX's quantized matmul and unpacked to fp32 for BLAS.
    monkeypatch.setattr(scratch, "DECODE_SCRATCH_BYTES", 1)
    cache = _cache("q6", 64, prefix=70)
    keys = _normal((1, cache.kv_heads, length, 64), 7)
    cache.update_and_fetch(keys, keys)
    queries = _normal((1, 4, length, 64), 8)

    def read() -> np.ndarray:
        mask = "causal" if length > 1 else None
        return np.array(attention.paged_attention(queries, keys, keys, cache, 0.125, mask))

    packed = read()
    monkeypatch.setattr(block_walk, "PACKED_READ_BITS", frozenset())
    np.testing.assert_allclose(packed, read(), atol=SAME_ROWS_TOLERANCE)


def test_window_mask_over_decode_blocks(monkeypatch) -> None:
    monkeypatch.setattr(scratch, "DECODE_SCRATCH_BYTES", 1)
    cache = _cache("fp16", 32, prefix=50)
    total = 51
    window = (mx.arange(total) >= total - 20)[None]  # reaches back across two pages
    got, expected = _step(cache, "fp16", 1, heads=4, mask=window, seed=3)
    np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


@pytest.mark.parametrize("mode", ["fp16", "q6"])
def test_decode_transient_is_one_block_at_any_context(mode: str, monkeypatch) -> None:
    # 2 KV heads of 128 values, 16-token pages: a 64 KiB decode budget makes
    # blocks of a few pages, so 4k tokens walk many blocks, each converted on its own.
    monkeypatch.setattr(scratch, "DECODE_SCRATCH_BYTES", 64 * 1024)
    peaks = [_decode_peak(_cache(mode, 128, prefix=tokens), heads=8) for tokens in (512, 4096)]
    # The converted keys and values of one block, plus the small running arrays;
    # converting the whole context would take 8 MiB.
    assert peaks[1] <= 64 * 1024 + 16 * 1024
    assert peaks[1] <= 1.5 * peaks[0] + 16 * 1024


# -- what the fit check predicts is what the attention allocates ---------------------


@pytest.mark.parametrize(
    ("chunk", "q_heads", "kv_heads", "head_dim", "page_size", "budget"),
    [(512, 24, 4, 256, 256, 256 * MIB), (64, 16, 4, 256, 256, 256 * MIB),
     (512, 4, 2, 32, 256, 256 * MIB), (128, 8, 2, 64, 16, 2 * MIB)],
)
def test_predicted_scratch_is_the_block_the_attention_sizes(
    chunk: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int, budget: int,
) -> None:
    rows = q_heads * chunk
    tokens = scratch.block_tokens(rows, kv_heads, head_dim, page_size, budget)
    assert tokens % page_size == 0
    long = scratch.chunk_scratch_bytes(chunk, q_heads, kv_heads, head_dim, page_size, budget)
    assert long <= budget  # the budget bounds the whole call, queries and output included
    # One page more per block would no longer fit the budget.
    per_page = (scratch.chunk_scratch_bytes(
        chunk, q_heads, kv_heads, head_dim, page_size, 2 * budget, tokens + page_size) - long)
    assert long + per_page > budget
    # A context shorter than one block makes a block of the context.
    short = scratch.chunk_scratch_bytes(
        chunk, q_heads, kv_heads, head_dim, page_size, budget, context=page_size)
    assert short == long - (tokens - page_size) * per_page // page_size


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize(("mode", "head_dim", "q_heads", "prefix"),
                         [("fp16", 64, 8, 4096), ("q6", 64, 8, 4096), ("q4", 128, 4, 4096),
                          ("q8", 64, 8, 200)])
def test_one_chunks_measured_peak_is_the_predicted_scratch(
    mode: str, head_dim: int, q_heads: int, prefix: int, cores: int, monkeypatch
) -> None:
    # A 4 MiB budget over 4,096 held tokens: several full blocks of 16-token pages.
    # Over 200, one block of every page. One core walks every head on one stream;
    # two split the heads over two.
    monkeypatch.setattr(streams, "cpu_cores", lambda: cores)
    monkeypatch.setattr(streams, "SPLIT_MIN_VALUES", 0)
    budget, chunk = 4 * MIB, 128
    cache = _cache(mode, head_dim, prefix=prefix)
    cache.pool.scratch_bytes = budget
    cache.pool.ensure(cache.offset + chunk)
    keys = _normal((1, cache.kv_heads, chunk, head_dim), 4)
    queries = _normal((1, q_heads, chunk, head_dim), 5)
    cache.update_and_fetch(keys, keys)
    # One call in a few dozen lets a stream free its block early and holds ~15%
    # less than the worst call, which the prediction must cover.
    measured = _attention_peak(cache, queries, "causal")
    predicted = scratch.chunk_scratch_bytes(
        chunk, q_heads, cache.kv_heads, head_dim, cache.pool.page_size, budget, cache.offset,
        streams.streams_for(cache.kv_heads))
    # Never more than predicted (beyond timing noise), and not far less.
    assert 0.75 * predicted <= measured <= 1.1 * predicted, (measured, predicted)


@pytest.mark.parametrize("mode", ["fp16", "q6"])
def test_heads_split_over_streams_attend_as_one_walk(mode: str, monkeypatch) -> None:
    # A prefill chunk over several blocks, some seen whole and some masked, with
    # the KV heads walked on one stream and on two.
    monkeypatch.setattr(streams, "SPLIT_MIN_VALUES", 0)
    outputs = []
    for cores in (1, 2):
        monkeypatch.setattr(streams, "cpu_cores", lambda cores=cores: cores)
        cache = _cache(mode, 64, prefix=300)
        cache.pool.scratch_bytes = 256 * 1024
        keys = _normal((1, cache.kv_heads, 40, 64), 6)
        queries = _normal((1, 8, 40, 64), 7)
        cache.update_and_fetch(keys, keys)
        outputs.append(np.array(
            attention.paged_attention(queries, keys, keys, cache, 64**-0.5, "causal")))
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1e-5)
