"""PagedKVCache: mlx-lm's cache protocol over pages (write, read, trim, state, masks)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import kvquant
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PageLayout, PagePool
from engine.errors import EngineError, KvBudgetExceeded

PAGE_SIZE = 16
KV_HEADS, HEAD_DIM = 2, 64


def _rows(length: int, seed: int) -> mx.array:
    return mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=mx.random.key(seed))


def _stored(x: mx.array, mode: str) -> np.ndarray:
    bits = kvquant.bits_for(mode)
    codes, scales = kvquant.quantize_rows(x, bits)
    return np.array(kvquant.dequantize_rows(codes, scales, bits, x.shape[-1]))


def _filled(mode: str, chunks: tuple[int, ...], pool: PagePool | None = None):
    cache = PagedKVCache(pool or PagePool(mode, PAGE_SIZE), KV_HEADS, HEAD_DIM)
    keys = [_rows(n, 2 * i) for i, n in enumerate(chunks)]
    values = [_rows(n, 2 * i + 1) for i, n in enumerate(chunks)]
    for k, v in zip(keys, values, strict=True):
        fetched_k, fetched_v = cache.update_and_fetch(k, v)
        assert fetched_k is k and fetched_v is v  # the new chunk, unchanged
    return cache, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_rows_land_in_pages_across_boundaries(mode: str) -> None:
    cache, keys, values = _filled(mode, (5, 20, 1, 13))  # 39 tokens, 3 pages
    assert cache.offset == cache.size() == 39 and len(cache.block_table) == 3
    k, v = cache.dequantized_prefix(39, mx.float32)
    np.testing.assert_array_equal(np.array(k), _stored(keys, mode))
    np.testing.assert_array_equal(np.array(v), _stored(values, mode))
    k, _ = cache.dequantized_prefix(17, mx.float32)
    np.testing.assert_array_equal(np.array(k), _stored(keys[:, :, :17], mode))


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_nbytes_is_the_storage_arithmetic_of_held_pages(mode: str) -> None:
    cache, _, _ = _filled(mode, (40,))
    assert cache.nbytes == kvquant.project_kv_bytes(1, KV_HEADS, HEAD_DIM, 3 * PAGE_SIZE, mode)
    assert cache.nbytes == 3 * PageLayout(mode, PAGE_SIZE, KV_HEADS, HEAD_DIM).page_bytes


def test_protocol_basics() -> None:
    cache = PagedKVCache(PagePool("q8", PAGE_SIZE), KV_HEADS, HEAD_DIM)
    assert cache.empty() and cache.nbytes == 0 and cache.is_trimmable()
    cache.update_and_fetch(_rows(3, 0), _rows(3, 1))
    assert not cache.empty() and cache.size() == 3


def test_layout_is_learned_on_first_write_when_not_given() -> None:
    cache = PagedKVCache(PagePool("q6", PAGE_SIZE))
    assert cache.nbytes == 0 and cache.empty()
    cache.update_and_fetch(_rows(3, 0), _rows(3, 1))
    assert (cache.kv_heads, cache.head_dim) == (KV_HEADS, HEAD_DIM)
    with pytest.raises(EngineError, match="2 KV heads of 64"):
        cache.update_and_fetch(mx.zeros((1, 4, 1, 64)), mx.zeros((1, 4, 1, 64)))


def test_batches_are_refused() -> None:
    cache = PagedKVCache(PagePool("q8", PAGE_SIZE), KV_HEADS, HEAD_DIM)
    with pytest.raises(EngineError, match="batch size must be 1"):
        cache.update_and_fetch(mx.zeros((2, 2, 1, 64)), mx.zeros((2, 2, 1, 64)))


def test_trim_releases_pages_and_rewrites_cleanly() -> None:
    cache, _, _ = _filled("q4", (50,))
    store = cache.store
    assert cache.trim(30) == 30 and cache.offset == 20
    assert len(cache.block_table) == 2 and store.in_use == 2
    assert cache.trim(100) == 20 and cache.offset == 0 and cache.empty()
    assert store.in_use == 0
    cache, keys, values = _filled("q4", (50,))
    cache.trim(30)
    tail_k, tail_v = _rows(7, 9), _rows(7, 10)
    cache.update_and_fetch(tail_k, tail_v)
    k, v = cache.dequantized_prefix(27, mx.float32)
    for got, old, tail in ((k, keys, tail_k), (v, values, tail_v)):
        expected = mx.concatenate([old[:, :, :20], tail], axis=2)
        np.testing.assert_array_equal(np.array(got), _stored(expected, "q4"))


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_state_round_trip(mode: str) -> None:
    cache, keys, _ = _filled(mode, (21, 6))
    restored = PagedKVCache.from_state(cache.state)
    assert restored.offset == 27 and restored.nbytes == cache.nbytes
    restored.meta_state = cache.meta_state
    assert restored.meta_state == cache.meta_state == (mode, str(PAGE_SIZE), "27", "", "0")
    for a, b in zip(restored.state, cache.state, strict=True):
        if isinstance(a, mx.array):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        else:
            assert a == b
    k, _ = restored.dequantized_prefix(27, mx.float32)
    np.testing.assert_array_equal(np.array(k), _stored(keys, mode))


def test_state_restores_into_a_budgeted_pool_or_refuses_cleanly() -> None:
    cache, _, _ = _filled("q8", (40,))
    page = PageLayout("q8", PAGE_SIZE, KV_HEADS, HEAD_DIM).page_bytes
    target = PagedKVCache(PagePool("q8", PAGE_SIZE, budget_bytes=3 * page), KV_HEADS, HEAD_DIM)
    target.update_and_fetch(_rows(5, 7), _rows(5, 8))
    target.state = cache.state
    assert target.offset == 40 and len(target.block_table) == 3
    small = PagedKVCache(PagePool("q8", PAGE_SIZE, budget_bytes=2 * page), KV_HEADS, HEAD_DIM)
    small.update_and_fetch(_rows(5, 7), _rows(5, 8))
    with pytest.raises(KvBudgetExceeded):
        small.state = cache.state
    assert small.offset == 5 and len(small.block_table) == 1  # unchanged
    other = PagedKVCache(PagePool("q4", PAGE_SIZE), KV_HEADS, HEAD_DIM)
    with pytest.raises(EngineError, match="q8 with 16-token pages"):
        other.state = cache.state


def test_incomplete_state_is_refused() -> None:
    cache, _, _ = _filled("q8", (40,))
    state = list(cache.state)
    state[4] = 60  # claims more tokens than its 3 pages hold
    target, _, _ = _filled("q8", (5,))
    with pytest.raises(EngineError, match="incomplete"):
        target.state = tuple(state)
    assert target.offset == 5


def test_empty_state_round_trip() -> None:
    cache = PagedKVCache(PagePool("q6", PAGE_SIZE), KV_HEADS, HEAD_DIM)
    restored = PagedKVCache.from_state(cache.state)
    assert restored.offset == 0 and restored.empty()


def test_meta_state_setter_checks_the_format() -> None:
    cache, _, _ = _filled("q8", (20,))
    cache.meta_state = ("q8", str(PAGE_SIZE), "20")
    assert cache.offset == 20
    with pytest.raises(EngineError):
        cache.meta_state = ("q4", str(PAGE_SIZE), "20")


def test_make_mask_follows_mlx_lm_and_reserves_pages() -> None:
    page = PageLayout("q8", PAGE_SIZE, KV_HEADS, HEAD_DIM).page_bytes
    cache = PagedKVCache(PagePool("q8", PAGE_SIZE, budget_bytes=2 * page), KV_HEADS, HEAD_DIM)
    assert cache.make_mask(10) == "causal"
    assert cache.store.capacity >= 1
    cache.update_and_fetch(_rows(10, 0), _rows(10, 1))
    assert cache.make_mask(1) is None
    window = cache.make_mask(1, window_size=4)
    assert np.array(window).tolist() == [[False] * 7 + [True] * 4]
    array = cache.make_mask(3, return_array=True)
    assert array.shape == (3, 13)
    with pytest.raises(KvBudgetExceeded):
        cache.make_mask(30)
    assert cache.offset == 10


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
def test_a_snapshot_stored_under_the_earlier_scale_cap_reads_back_finite(mode: str) -> None:
    from engine.cache.attention import dispatch, schedule

    bits, head_dim = kvquant.bits_for(mode), 32
    source = PagedKVCache(PagePool(mode, 4), 1, head_dim)
    rows = mx.random.normal((1, 1, 4, head_dim), key=mx.random.key(0))
    source.update_and_fetch(rows, rows)
    state = list(source.state)
    # Every code at its largest, each scale at the earlier cap (which kept only the
    # bias finite): MLX's float16 read of such a code is inf.
    codes, scales = kvquant.quantize_rows(mx.full((1, 1, 4, head_dim), 1.0), bits)
    earlier = mx.full(scales.shape, kvquant._largest_fp16_scale(kvquant.bias_for(bits)),
                      dtype=mx.float16)
    state[:4] = [codes, earlier, codes, earlier]
    restored = PagedKVCache(PagePool(mode, 4), 1, head_dim)
    restored.state = tuple(state)
    query = (mx.random.normal((1, 1, 1, head_dim), key=mx.random.key(1)) * 1e-3)
    with schedule.forced("gpu"):
        out = dispatch.paged_attention(query.astype(mx.float16), None, None, restored,
                                       head_dim ** -0.5)
    assert bool(mx.all(mx.isfinite(out.astype(mx.float32))))
    keys, _ = restored.dequantized_prefix(4, mx.float32)
    limit = kvquant.qmax_for(bits) * kvquant.scale_cap(bits)
    assert np.allclose(np.array(keys), limit, rtol=1e-3)  # clipped at the cap's range
