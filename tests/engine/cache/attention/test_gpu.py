"""The GPU schedule's attention: its prefill's blocks and memory, its whole-context reads.

Its graphs counted on a GPU's terms are in ``tests/benchmarks/test_kernels_bench.py``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache.attention import dispatch as attention
from engine.cache.attention import schedule, scratch
from tests.engine.cache.attention.test_block_walk import _attention_peak
from tests.engine.cache.attention.test_dispatch import (
    SAME_ROWS_TOLERANCE,
    _cache,
    _move_page,
    _normal,
    _step,
)

MIB = 2**20


@pytest.fixture(autouse=True)
def gpu_schedule():
    with schedule.forced(schedule.GPU):
        yield


@pytest.mark.parametrize("mode", ["fp16", "q8", "q6"])
def test_a_prefill_chunk_over_many_blocks_matches_reference(mode: str) -> None:
    cache = _cache(mode, 64, prefix=300)
    cache.pool.scratch_bytes = 64 * 1024  # blocks of a page or two: many merges
    for seed, mask in ((3, "causal"), (9, None)):
        got, expected = _step(cache, mode, 40, heads=4, mask=mask, seed=seed)
        np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


def test_a_row_a_block_hides_whole_merges_with_no_weight() -> None:
    # A chunk whose later queries' blocks come after its earlier queries' positions:
    # each early row sees none of the last block, which must add nothing (no NaN).
    cache = _cache("q8", 64, prefix=16)
    cache.pool.scratch_bytes = 32 * 1024
    got, expected = _step(cache, "q8", 64, heads=4, mask="causal", seed=5)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


def test_an_additive_window_mask_hiding_whole_blocks_reads_as_the_same_bool_mask() -> None:
    """An additive mask's -inf hides a column as a bool mask's False does: a block a
    window hides from some rows entirely must not turn their softmax into NaN."""
    from mlx_lm.models.base import create_causal_mask

    window = create_causal_mask(24, 40, window_size=8)
    additive = mx.where(window, 0.0, -mx.inf)
    outputs, references = [], []
    for mask in (window, additive):
        cache = _cache("q8", 64, prefix=40)
        cache.pool.scratch_bytes = 1  # a page a block: most blocks are out of the window
        got, expected = _step(cache, "q8", 24, heads=4, mask=mask, seed=5)
        outputs.append(got)
        references.append(expected)
    np.testing.assert_allclose(outputs[0], references[0], atol=SAME_ROWS_TOLERANCE)
    assert np.isfinite(outputs[1]).all()
    np.testing.assert_allclose(outputs[1], outputs[0], atol=SAME_ROWS_TOLERANCE)


@pytest.mark.parametrize(("mode", "prefix"), [("fp16", 4096), ("q6", 1024)])
def test_one_chunks_measured_peak_is_the_predicted_scratch(mode: str, prefix: int) -> None:
    # 16-bit queries, as a GPU computes; a 4 MiB budget over 16-token pages: many
    # blocks (q6's fewer: the CPU backend's float16 quantized matmul is slow). The
    # CPU backend runs one block at a time where a GPU may hold two (which the
    # prediction counts), so the measure here is about half the prediction, and
    # never above it.
    budget, chunk, q_heads, head_dim = 4 * MIB, 128, 8, 64
    cache = _cache(mode, head_dim, prefix=prefix)
    cache.pool.scratch_bytes = budget
    cache.pool.ensure(cache.offset + chunk)
    keys = _normal((1, cache.kv_heads, chunk, head_dim), 4).astype(mx.float16)
    cache.update_and_fetch(keys, keys)
    queries = _normal((1, q_heads, chunk, head_dim), 5).astype(mx.float16)
    # One stream, one block at a time: the peak does not move between calls.
    measured = _attention_peak(cache, queries, "causal", repeats=1)
    predicted = scratch.chunk_scratch_bytes(
        chunk, q_heads, cache.kv_heads, head_dim, cache.pool.page_size, budget, cache.offset,
        gpu=True)
    assert predicted <= budget
    assert 0.35 * predicted <= measured <= 1.1 * predicted, (measured, predicted)


def test_the_schedules_differ_only_by_the_dtypes_rounding() -> None:
    cache = _cache("q6", 64, prefix=200)
    queries = _normal((1, 4, 1, 64), 8)
    gpu = attention.paged_attention(queries, None, None, cache, 0.125)
    with schedule.forced(schedule.CPU):
        cpu = attention.paged_attention(queries, None, None, cache, 0.125)
    np.testing.assert_allclose(np.array(gpu), np.array(cpu), atol=SAME_ROWS_TOLERANCE)


@pytest.mark.parametrize("mode", ["fp16", "q8", "q6"])
@pytest.mark.parametrize("shuffled", [False, True])
def test_whole_context_reads_match_the_reference_in_float16(mode: str, shuffled: bool) -> None:
    # A float16 model's decode steps and verifications read every column at once;
    # a block table out of slot order reads them by their positions.
    cache = _cache(mode, 64, prefix=100)
    if shuffled:
        cache.pool.ensure(cache.offset + 6 * 16)
        store = cache.store
        slot = store.take()
        _move_page(cache, 2, slot)
        assert cache.columns()[1] is not None
    for length, mask in ((1, None), (3, "causal")):
        keys = _normal((1, cache.kv_heads, length, 64), length).astype(mx.float16)
        queries = _normal((1, 4, length, 64), length + 1).astype(mx.float16)
        cache.update_and_fetch(keys, keys)
        out = attention.paged_attention(queries, keys, keys, cache, 0.125, mask)
        stored_k, stored_v = cache.dequantized_prefix(cache.offset, mx.float32)
        expected = mx.fast.scaled_dot_product_attention(
            queries.astype(mx.float32), stored_k, stored_v, scale=0.125, mask=mask)
        assert float(mx.abs(out.astype(mx.float32) - expected).max()) < 5e-3
