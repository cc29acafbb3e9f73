"""PagePool and PageStore: free list, growth and shrinking, budget, sizes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import kvquant, pages
from engine.cache.pages import PageLayout, PagePool
from engine.errors import KvBudgetExceeded, UnsupportedModeError


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_page_bytes_follow_the_storage_arithmetic(mode: str) -> None:
    layout = PageLayout(mode, 256, 4, 256)
    assert layout.page_bytes == 256 * 4 * kvquant.kv_bytes_per_token(256, mode)
    in_memory = {"q8": 528, "q6": 400, "q4": 272, "fp16": 1024}  # bytes per token per head
    assert layout.page_bytes == 256 * 4 * in_memory[mode]


def test_storage_is_heads_first_with_a_scale_and_bias_per_group() -> None:
    pool = PagePool("q6", 16)
    store = pool.add_store(kv_heads=2, head_dim=64)
    pool.ensure(1)
    k_codes, k_scales, v_codes, v_scales = store.parts
    for codes, scales in ((k_codes, k_scales), (v_codes, v_scales)):
        assert codes.shape == (2, 4 * 16, 48) and codes.dtype == mx.uint8
        assert scales.shape == (2, 2, 4 * 16, 1) and scales.dtype == mx.float16
    assert sum(a.nbytes for a in store.arrays()) == 4 * store.layout.page_bytes
    fp16 = PagePool("fp16", 16).add_store(2, 64)
    fp16.grow(1)
    assert fp16.parts[0].dtype == mx.float16 and fp16.parts[1] is None


def test_q6_needs_head_dim_divisible_by_4() -> None:
    with pytest.raises(UnsupportedModeError, match=r"head_dim is 30.*q8 or q4"):
        PagePool("q6").add_store(kv_heads=2, head_dim=30)


def test_bad_page_size() -> None:
    with pytest.raises(ValueError, match="page_size"):
        PagePool("q8", 0)


def test_free_list_hands_out_lowest_slot_first() -> None:
    store = PagePool("q8", 16).add_store(2, 32)
    store.grow(4)
    taken = [store.take() for _ in range(3)]
    assert taken == [0, 1, 2] and store.in_use == 3 and store.free_count == 1
    store.give_back([1, 0])
    assert store.take() == 0 and store.take() == 1 and store.take() == 3


def test_growth_keeps_every_row_it_held() -> None:
    pool = PagePool("q4", 16)
    store = pool.add_store(2, 32)
    pool.ensure(16)
    slot = store.take()
    rows = mx.random.randint(0, 255, (2, 16, 16), key=mx.random.key(0)).astype(mx.uint8)
    pairs = mx.random.uniform(shape=(2, 2, 16, 1), key=mx.random.key(1)).astype(mx.float16)
    store.write(slot, 0, (rows, pairs, rows, pairs))
    sizes = []
    for tokens in (16 * 5, 16 * 9, 16 * 17, 16 * 40):
        pool.ensure(tokens)
        for slot in range(store.in_use, pool.pages_for(tokens)):
            assert store.take() == slot
        sizes.append(store.capacity)
    assert sizes == [8, 16, 32, 64]  # doubling: few copies over a growing context
    held = store.rows(0, 0, 16)
    np.testing.assert_array_equal(np.array(held[0]), np.array(rows))
    np.testing.assert_array_equal(np.array(held[1]), np.array(pairs))


def test_growth_stops_doubling_at_the_cap_then_adds_half_the_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pages, "MAX_GROWTH_BYTES", 8 * PageLayout("q8", 4, 1, 32).page_bytes)
    pool = PagePool("q8", 4)
    store = pool.add_store(1, 32)
    sizes = []
    for tokens in range(4, 4 * 400, 4):
        before = store.capacity
        pool.ensure(tokens)
        if store.capacity != before:
            sizes.append((before, store.capacity - before))
    assert all(size <= max(8, before // 2, 4) for before, size in sizes), sizes
    assert [size for _, size in sizes[:3]] == [4, 4, 8]  # doubling up to the cap
    assert store.capacity >= 399 and len(sizes) <= 12


def test_budget_is_all_or_nothing_across_layers() -> None:
    per_page = PageLayout("q8", 16, 2, 32).page_bytes + PageLayout("q8", 16, 4, 64).page_bytes
    pool = PagePool("q8", 16, budget_bytes=5 * per_page)
    small, large = pool.add_store(2, 32), pool.add_store(4, 64)
    pool.ensure(16 * 5)
    assert small.capacity == large.capacity == 5
    assert pool.bytes_allocated == 5 * per_page
    assert pool.tokens_fit() == 80
    with pytest.raises(KvBudgetExceeded) as raised:
        pool.ensure(81)
    assert (small.capacity, large.capacity) == (5, 5)
    error = raised.value
    assert error.tokens_fit == 80 and error.tokens_requested == 81
    assert error.suggested_mode == "q6"


def test_growth_under_a_budget_stays_symmetric() -> None:
    per_page = 2 * PageLayout("q8", 16, 2, 32).page_bytes
    pool = PagePool("q8", 16, budget_bytes=11 * per_page)
    stores = [pool.add_store(2, 32), pool.add_store(2, 32)]
    for tokens in range(16, 16 * 11 + 1, 16):
        pool.ensure(tokens)
        assert stores[0].capacity == stores[1].capacity >= pool.pages_for(tokens)
        assert pool.bytes_allocated <= 11 * per_page
    assert pool.tokens_fit() == 16 * 11


def test_suggestion_skips_modes_that_do_not_fit_or_apply() -> None:
    pool = PagePool("fp16", 16, budget_bytes=2 * PageLayout("fp16", 16, 1, 64).page_bytes)
    pool.add_store(1, 64)
    with pytest.raises(KvBudgetExceeded) as raised:
        pool.ensure(33)
    assert raised.value.tokens_fit == 32
    assert raised.value.suggested_mode == "q8"  # the best mode that holds 33 tokens
    pool = PagePool("q8", 16, budget_bytes=2 * PageLayout("q8", 16, 1, 34).page_bytes)
    pool.add_store(1, 34)  # q6 cannot store head_dim 34; q4 holds 3 pages here
    with pytest.raises(KvBudgetExceeded) as raised:
        pool.ensure(33)
    assert raised.value.suggested_mode == "q4"
    with pytest.raises(KvBudgetExceeded) as raised:
        pool.ensure(16 * 10)
    assert raised.value.suggested_mode is None
    assert "raise the KV memory budget" in str(raised.value)


def test_unbudgeted_pool_always_fits() -> None:
    pool = PagePool("q4", 16)
    pool.add_store(2, 32)
    pool.ensure(10_000)
    assert pool.tokens_fit() > 10**12


def test_write_and_gather_rows_in_place() -> None:
    store = PagePool("q8", 8).add_store(2, 32)
    store.grow(5)
    rows = mx.random.randint(0, 255, (2, 5, 32), key=mx.random.key(0)).astype(mx.uint8)
    scales = mx.random.uniform(shape=(2, 5, 1), key=mx.random.key(1)).astype(mx.float16)
    pairs = kvquant.affine_scales(scales, 8, 1)
    store.write(3, 2, (rows, pairs, rows, pairs))
    k_codes, k_scales, _, _ = store.gather([3, 0])
    np.testing.assert_array_equal(np.array(k_codes[0, :, 2:7]), np.array(rows))
    np.testing.assert_array_equal(np.array(k_scales[0, :, 2:7]), np.array(scales))
    assert not np.array(k_codes[0, :, :2]).any() and not np.array(k_codes[1]).any()


def test_a_write_runs_on_through_consecutive_slots() -> None:
    store = PagePool("fp16", 4).add_store(1, 32)
    store.grow(4)
    rows = mx.arange(10 * 32, dtype=mx.float16).reshape(1, 10, 32)
    store.write(1, 1, (rows, None, rows, None))  # slot 1 from row 1, then slots 2 and 3
    np.testing.assert_array_equal(np.array(store.columns(0, 16)[0, 5:15]), np.array(rows[0]))


def test_gather_is_page_major_in_the_row_format() -> None:
    store = PagePool("q6", 4).add_store(3, 32)
    store.grow(5)
    for slot in range(5):
        codes = mx.full((3, 4, 24), slot + 1, dtype=mx.uint8) + mx.arange(3)[:, None, None]
        pairs = kvquant.affine_scales(mx.full((3, 4, 1), slot + 1, mx.float16), 6, 1)
        store.write(slot, 0, (codes, pairs, codes, pairs))
    k_codes, k_scales, _, _ = store.gather([4, 0, 2, 1])
    assert k_codes.shape == (4, 3, 4, 24) and k_scales.shape == (4, 3, 4, 1)
    assert np.array(k_codes)[:, 0, 0, 0].tolist() == [5, 1, 3, 2]
    assert np.array(k_codes)[0, :, 0, 0].tolist() == [5, 6, 7]
    assert np.array(k_scales)[:, 0, 0, 0].tolist() == [5, 1, 3, 2]


def test_trim_gives_the_free_tail_back() -> None:
    """Trimmed and closed sessions used to keep their storage (371 MiB after 20k -> 0)."""
    from engine.cache.paged_cache import PagedKVCache

    pool = PagePool("q8", page_size=16)
    cache = PagedKVCache(pool, 2, 64)
    rows = mx.zeros((1, 2, 1000, 64))
    for _ in range(5):
        cache.update_and_fetch(rows, rows)
    full = pool.bytes_allocated
    assert full >= pool.pages_for(5000) * cache.store.layout.page_bytes
    cache.trim(4000)
    assert cache.offset == 1000
    assert pool.bytes_allocated < full / 2
    assert pool.bytes_allocated >= pool.pages_for(1000) * cache.store.layout.page_bytes
    cache.trim(1000)
    assert pool.bytes_allocated == 0 and cache.store.capacity == 0
    cache.update_and_fetch(rows, rows)  # grows again from nothing
    assert cache.offset == 1000 and pool.bytes_allocated > 0


def test_a_long_context_grows_a_layer_a_dozen_times_not_hundreds() -> None:
    pool = PagePool("fp16", page_size=256)
    store = pool.add_store(4, 256)  # 1 MiB pages
    growths = 0
    for tokens in range(512, 262144 + 1, 512):
        before = store.capacity
        pool.ensure(tokens)
        growths += store.capacity != before
    assert store.capacity >= 1024 and growths <= 14


@pytest.mark.parametrize("mode", ["fp16", "q8"])
def test_a_layer_never_grows_past_the_pages_of_the_context(mode: str) -> None:
    pool = PagePool(mode, page_size=256)
    pool.max_tokens = 262_144  # the seed model's context
    store = pool.add_store(4, 256)
    for tokens in range(512, 262_144 + 1, 512):
        pool.ensure(tokens)
    # Filled to the context: every page in use, none held past it (growth ahead
    # doubled, then added half its size, well past 1,024 pages before).
    assert store.capacity == 1024
    pool.ensure(262_144 + 1)  # the bound is on growth ahead, not on what is asked
    assert store.capacity == 1025


def test_growing_holds_one_old_array_at_a_time() -> None:
    # fp16, 2 heads of 64: each of the two arrays is 256 KiB at 64 pages of 16.
    pool = PagePool("fp16", 16)
    store = pool.add_store(2, 64)
    pool.ensure(64 * 16)
    old_part = store.layout.part_bytes(64 * 16)
    mx.synchronize()
    mx.clear_cache()
    other = mx.get_active_memory() - sum(a.nbytes for a in store.arrays())
    mx.reset_peak_memory()
    pool.ensure(65 * 16)  # doubles: two new 512 KiB arrays
    peak = mx.get_peak_memory() - other
    new_total = sum(a.nbytes for a in store.arrays())
    assert new_total == 2 * 2 * old_part
    # The new arrays and one old one at most, and a scalar or two (keeping both old
    # arrays would hold 1.5 MiB).
    assert peak <= new_total + old_part + 1024
    assert pool.growth_transient_bytes(64 * 16) == old_part
